"""docs/audit.md names only what exists: every function it says keeps a promise is a function
of one of the five role files, every test it says proves one is a test of the suite, and every
row of the map names at least one of each. Read with `ast` (nothing is imported, no Docker).

The checker takes the document's text, so the negative cases below feed it small documents
with one name misspelt, misplaced or missing, and expect it to say so.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AUDIT_MAP = ROOT / "docs" / "audit.md"

#: The files a promise may be kept in: the five role files, the Python client and its
#: Inspect AI provider.
ROLE_FILES = ("reploy.py", "reploy_serve.py", "reploy_session_client.py", "reploy_watchdog.py",
              "agent.py", "reploy_client.py", "reploy_inspect.py")
#: The map's tables, and the one of promises no test proves yet (a gap: no test named).
MAP_HEADER = ("promise", "kept by", "proved by")
GAP_HEADER = ("promise", "kept by", "what a test would have to show")

#: A backticked span is a reference when it names a .py file followed by a colon.
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REFERENCE = re.compile(r"\.py::?")
#: `file.py:function` or `file.py:Class.method`.
FUNCTION_REF = re.compile(r"(?P<file>[A-Za-z0-9_]+\.py):"
                          r"(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
#: `tests/test_x.py::test_name` or `tests/test_x.py::TestClass::test_name` (no parameters).
TEST_ID = re.compile(r"(?P<file>tests/test_\w+\.py)::"
                     r"(?:(?P<cls>[A-Za-z_]\w*)::)?(?P<name>[A-Za-z_]\w*)")


# ---------------------------------------------------------------------------------------------
# What exists, read with ast
# ---------------------------------------------------------------------------------------------


@cache
def definitions(path: Path) -> frozenset[str]:
    """A module's functions (`name`) and its classes' methods (`Class.method`); nothing nested
    inside a function counts, since nobody can call it by that name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(names)


def is_test(name: str) -> bool:
    return name.startswith("test")


def collected_test_ids(path: Path) -> frozenset[str]:
    """The ids pytest collects from a test module: `test_name` and `TestClass::test_name`."""
    ids = set()
    for name in definitions(path):
        cls, _, method = name.rpartition(".")
        if not cls and is_test(name):
            ids.add(name)
        elif cls.startswith("Test") and is_test(method):
            ids.add(f"{cls}::{method}")
    return frozenset(ids)


# ---------------------------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    map_rows: int = 0
    gap_rows: int = 0


def check_reference(text: str, root: Path) -> tuple[str, str]:
    """The kind of a reference ("function" or "test") and the problem with it ("" if none)."""
    function = FUNCTION_REF.fullmatch(text)
    if function:
        file, name = function["file"], function["name"]
        if file not in ROLE_FILES:
            return "function", f"`{text}`: {file} is not a role file ({', '.join(ROLE_FILES)})"
        if not (root / file).is_file() or name not in definitions(root / file):
            return "function", f"`{text}`: {file} has no function or method {name}"
        return "function", ""
    test = TEST_ID.fullmatch(text)
    if test:
        path = root / test["file"]
        wanted = f"{test['cls']}::{test['name']}" if test["cls"] else test["name"]
        if not path.is_file():
            return "test", f"`{text}`: there is no {test['file']}"
        if wanted not in collected_test_ids(path):
            return "test", f"`{text}`: {test['file']} has no test {wanted}"
        return "test", ""
    return "", (f"`{text}`: not `file.py:function`, `file.py:Class.method` or "
                "`tests/test_x.py::test_name` (no parameters in brackets)")


def references(cell: str, root: Path, report: Report) -> dict[str, int]:
    """How many references of each kind a piece of text holds; problems go to the report."""
    counts = {"function": 0, "test": 0}
    for span in CODE_SPAN.findall(cell):
        if not REFERENCE.search(span):
            continue  # a flag, a path, a status code: prose
        kind, problem = check_reference(span.strip(), root)
        if problem:
            report.problems.append(problem)
        if kind:
            counts[kind] += 1
    return counts


def table_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def check_audit_map(text: str, root: Path = ROOT) -> Report:
    """Every reference in the document, and the rows of its tables: a map row names at least one
    function (kept by) and one test (proved by); a gap row at least one function and no test."""
    report = Report()
    header: tuple[str, ...] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            references(line, root, report)
            continue
        cells = table_cells(line)
        if header is None:
            header = tuple(cell.lower() for cell in cells)
            if header not in (MAP_HEADER, GAP_HEADER):
                report.problems.append(f"line {number}: a table whose header is neither "
                                       f"{' | '.join(MAP_HEADER)} nor {' | '.join(GAP_HEADER)}")
            continue
        if all(set(cell) <= set("-: ") for cell in cells):
            continue  # the separator row
        if len(cells) != len(header):
            report.problems.append(f"line {number}: {len(cells)} cells, not {len(header)}")
            continue
        promise, kept, proved = (references(cell, root, report) for cell in cells)
        what = f"line {number} ({cells[0][:60]})"
        if promise["function"] or promise["test"]:
            report.problems.append(f"{what}: the promise column names no function or test")
        if kept["function"] == 0 or kept["test"]:
            report.problems.append(f"{what}: `kept by` must name functions, and at least one")
        if header == MAP_HEADER:
            report.map_rows += 1
            if proved["test"] == 0 or proved["function"]:
                report.problems.append(f"{what}: `proved by` must name tests, and at least one")
        elif header == GAP_HEADER:
            report.gap_rows += 1
            if proved["test"] or proved["function"]:
                report.problems.append(f"{what}: a gap names no test (a proved promise is a "
                                       "map row)")
    return report


# ---------------------------------------------------------------------------------------------
# The map itself
# ---------------------------------------------------------------------------------------------


def test_every_name_in_the_audit_map_exists() -> None:
    report = check_audit_map(AUDIT_MAP.read_text())
    assert report.problems == []
    assert report.map_rows >= 80  # the map covers the README's promises, not a sample of them


def test_the_audit_map_covers_privilege_separation() -> None:
    """Issue 21's boundary has rows of its own: the identities, the agent's own directory, the
    impostor, the kernel-confined files API, the session disk and setuid bits."""
    text = AUDIT_MAP.read_text()
    section = re.search(r"^## Managed sessions: privilege separation$(.*?)^## ", text,
                        re.MULTILINE | re.DOTALL)
    assert section is not None
    rows = [line for line in section.group(1).splitlines()
            if line.startswith("| ") and not line.startswith("| promise")]
    assert len(rows) >= 8, rows


# ---------------------------------------------------------------------------------------------
# The checker, on small documents
# ---------------------------------------------------------------------------------------------


def document(kept: str, proved: str, header: tuple[str, ...] = MAP_HEADER) -> str:
    return "\n".join(("# A map", "", "| " + " | ".join(header) + " |", "|---|---|---|",
                      f"| a promise | {kept} | {proved} |", ""))


GOOD_KEPT = "`reploy.py:HostCore.latch`, `reploy.py:parse_duration_ms`"
GOOD_PROVED = "`tests/test_lifecycle.py::test_first_cause_is_latched`"


def test_a_document_naming_what_exists_passes() -> None:
    report = check_audit_map(document(GOOD_KEPT, GOOD_PROVED))
    assert (report.problems, report.map_rows) == ([], 1)
    gap = check_audit_map(document("`agent.py:parse_request`", "a line the map fails on",
                                   GAP_HEADER))
    assert (gap.problems, gap.gap_rows) == ([], 1)


def test_test_ids_in_a_class_and_methods_are_found(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_thing.py").write_text(
        "class TestThing:\n    def test_holds(self):\n        pass\n\n"
        "def helper():\n    def test_nested():\n        pass\n")
    (tmp_path / "agent.py").write_text("class Core:\n    def keep(self):\n        pass\n")
    kept = "`agent.py:Core.keep`"
    in_class = "`tests/test_thing.py::TestThing::test_holds`"
    report = check_audit_map(document(kept, in_class), tmp_path)
    assert report.problems == []
    nested = check_audit_map(document(kept, "`tests/test_thing.py::test_nested`"), tmp_path)
    assert nested.problems == [
        "`tests/test_thing.py::test_nested`: tests/test_thing.py has no test test_nested"]


@pytest.mark.parametrize(("kept", "proved", "complaint"), [
    # A function or method misspelt, in the wrong class, in the wrong file, or nested.
    ("`reploy.py:parse_duraton_ms`", GOOD_PROVED, "has no function or method parse_duraton_ms"),
    ("`reploy.py:HostCore.latc`", GOOD_PROVED, "method HostCore.latc"),
    ("`reploy.py:RunResult.terminate`", GOOD_PROVED, "no function or method RunResult.terminate"),
    ("`agent.py:decide_access`", GOOD_PROVED, "agent.py has no function or method decide_access"),
    ("`reploy.py:inner`", GOOD_PROVED, "no function or method inner"),  # nested in _docker_call
    ("`reploy.py:HostCore.latch.x`", GOOD_PROVED, "not `file.py:function`"),
    # A file that is no role file.
    ("`reploy_serv.py:decide_access`", GOOD_PROVED, "reploy_serv.py is not a role file"),
    ("`conftest.py:stage_and_build`", GOOD_PROVED, "conftest.py is not a role file"),
    # A test misspelt, in a file that does not exist, with parameters, or a helper, not a test.
    (GOOD_KEPT, "`tests/test_lifecycle.py::test_first_cause_is_latchd`",
     "tests/test_lifecycle.py has no test test_first_cause_is_latchd"),
    (GOOD_KEPT, "`tests/test_lifecycles.py::test_first_cause_is_latched`",
     "there is no tests/test_lifecycles.py"),
    (GOOD_KEPT, "`tests/test_lifecycle.py::TestMachine::test_first_cause_is_latched`",
     "has no test TestMachine::test_first_cause_is_latched"),
    (GOOD_KEPT, "`tests/test_lifecycle.py::test_every_edge_follows_the_table[phase0]`",
     "no parameters in brackets"),
    (GOOD_KEPT, "`tests/test_controlled_session_failures.py::assert_sandboxed`",
     "has no test assert_sandboxed"),
    (GOOD_KEPT, "`tests/serve_harness.py::wait_until`", "not `file.py:function`"),
    # A row that names no function, or no test, or each in the other's column.
    ("the lifecycle machine", GOOD_PROVED, "`kept by` must name functions"),
    (GOOD_KEPT, "the lifecycle tests", "`proved by` must name tests"),
    (GOOD_PROVED, GOOD_KEPT, "`kept by` must name functions"),
])
def test_a_wrong_name_or_an_incomplete_row_is_found(kept: str, proved: str, complaint: str) -> None:
    report = check_audit_map(document(kept, proved))
    assert any(complaint in problem for problem in report.problems), report.problems


def test_names_outside_the_tables_are_checked_too() -> None:
    report = check_audit_map(document(GOOD_KEPT, GOOD_PROVED) + "See `reploy.py:mian`.\n")
    assert report.problems == ["`reploy.py:mian`: reploy.py has no function or method mian"]


def test_a_table_of_another_shape_and_a_gap_naming_a_test_are_refused() -> None:
    odd = check_audit_map(document(GOOD_KEPT, GOOD_PROVED, ("promise", "code", "test")))
    assert any("a table whose header" in problem for problem in odd.problems)
    gap = check_audit_map(document(GOOD_KEPT, GOOD_PROVED, GAP_HEADER))
    assert any("a gap names no test" in problem for problem in gap.problems)
