"""`reploy build`'s progress: the build's lines on stderr as the build runs (none with -q),
stdout one JSON result, a failure named by its step with that step's own last lines, and the
build's text (the Dockerfile author's and the base image's) made safe for a terminal."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import reploy
from conftest import ROOT, run_reploy

WORKLOAD = ROOT / "examples/workload/workload.blueprint.yaml"
BASE = "FROM reploy-base/busybox:1\n"
#: What a failing step prints: a package manager's error line, written so that the Dockerfile
#: (which the engine's own error quotes) does not hold it.
FAILING_STEP = "RUN printf 'E: Unable to locate package %s\\n' foo >&2; exit 100\n"
FAILING_LINE = "E: Unable to locate package foo"
#: A byte a terminal acts on: C0 and C1 controls, DEL, and no newline (the line break).
TERMINAL_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
BUILD_TIMEOUT_S = 180
#: How long the step the test unblocks waits before it fails the build on its own.
STEP_WAIT_S = 60


def staged_with(tmp_path: Path, dockerfile: str) -> Path:
    """A staged deployment whose context builds `dockerfile`."""
    directory = tmp_path / "deployment"
    proc = run_reploy("stage", str(WORKLOAD), "--dir", str(directory))
    assert proc.returncode == 0, proc.stderr.decode()
    (directory / "context/Dockerfile").write_text(dockerfile)
    return directory


def one_result(stdout: bytes) -> dict[str, Any]:
    """stdout as exactly one JSON document on one line: the build result."""
    assert stdout.count(b"\n") == 1 and stdout.endswith(b"\n"), stdout
    result = json.loads(stdout)
    assert result["schema"] == reploy.BUILD_SCHEMA
    return result


@pytest.mark.docker
@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_a_failed_build_names_its_step_and_shows_the_steps_own_output(
        docker_engine: Any, tmp_path: Path, quiet: bool) -> None:
    directory = staged_with(tmp_path, BASE + FAILING_STEP)
    proc = run_reploy("build", *(["-q"] if quiet else []), "--dir", str(directory))
    result = one_result(proc.stdout)
    assert proc.returncode == 1 and result["ok"] is False
    assert isinstance(result["error"], str)
    stderr = proc.stderr.decode()
    error_line = stderr[stderr.index("reploy: build: "):]
    for told in (result["error"], error_line):
        assert "Step 2/" in told and "exit 100" in told and FAILING_LINE in told
    progress = stderr[:stderr.index("reploy: build: ")]
    if quiet:  # (a reconciliation of another run's crash may be logged: not the build's)
        assert "Step " not in progress and FAILING_LINE not in progress
    else:  # each step's line, and the failing step's output, as the build went
        assert re.search(r"^Step 1/[0-9]+ : FROM reploy-base/busybox:1$", progress, re.M)
        assert progress.index("Step 2/") < progress.index(FAILING_LINE)


@pytest.mark.docker
def test_progress_is_shown_while_the_build_runs(docker_engine: Any, tmp_path: Path) -> None:
    """The build's second step waits for a file that the test creates in the step's container
    only once it has read that step's lines on stderr: progress that came only at the end could
    not be read before the step gave up waiting (STEP_WAIT_S), failing the build."""
    marker = f"progress-{secrets.token_hex(8)}"  # never in the engine's cache: the step runs
    directory = staged_with(tmp_path, BASE + f"RUN echo {marker} && i=0 && until [ -e /tmp/go ] "
                                             f"|| [ $i -ge {STEP_WAIT_S * 10} ]; do sleep 0.1; "
                                             "i=$((i+1)); done && [ -e /tmp/go ]\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), "build", "--dir",
                             str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    step_container = None
    image_id = None
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        while not (seen and seen[-1] == marker):
            line = proc.stderr.readline().decode()
            assert line, f"stderr ended before the step's output: {seen}"
            seen.append(line.rstrip("\n"))
            running = re.fullmatch(r"---> Running in ([0-9a-f]{12})", seen[-1])
            if running:
                step_container = docker_engine.containers.get(running.group(1))
        assert proc.poll() is None  # the step waits for /tmp/go: the build is still running
        assert any(re.fullmatch(r"Step 2/[0-9]+ : RUN echo .*", line) for line in seen), seen
        assert step_container is not None
        assert step_container.exec_run(["touch", "/tmp/go"]).exit_code == 0
        stdout, rest = proc.communicate(timeout=BUILD_TIMEOUT_S)
        result = one_result(stdout)
        assert proc.returncode == 0 and result["ok"] is True, rest
        image_id = result["generation"]["image_id"]
        assert "Successfully built" in rest.decode()  # the steps after, through the end
    finally:
        if proc.poll() is None:  # the test failed while the step waited: end the build
            if step_container is not None:
                step_container.kill()
            proc.communicate(timeout=BUILD_TIMEOUT_S)
        if image_id is not None:
            docker_engine.images.remove(image_id)


@pytest.mark.docker
def test_control_bytes_in_the_build_output_reach_stderr_made_safe(docker_engine: Any,
                                                                  tmp_path: Path) -> None:
    """A title change (OSC ... BEL), a screen clear (CSI), and a C1 CSI: each shown as text,
    none as the byte a terminal acts on, in the progress and in the error alike."""
    directory = staged_with(tmp_path, BASE + "RUN printf '\\033]0;pwned\\007x\\n"
                                             "\\033[2Jcleared\\n\\302\\2333Jc1\\n'; exit 1\n")
    proc = run_reploy("build", "--dir", str(directory))
    result = one_result(proc.stdout)
    assert proc.returncode == 1 and result["ok"] is False
    stderr = proc.stderr.decode()
    for shown in (stderr, result["error"]):
        assert "]0;pwned x" in shown and "[2Jcleared" in shown and "3Jc1" in shown
        assert not TERMINAL_CONTROL.search(shown.replace("\n", "")), shown


def fed(*chunks: Any) -> tuple[reploy.BuildProgress, list[str]]:
    progress = reploy.BuildProgress()
    shown = [line for chunk in chunks for line in progress.feed(chunk)] + progress.end()
    return progress, shown


def test_a_failure_keeps_only_the_last_lines_of_the_failing_step() -> None:
    """At most BUILD_TAIL_LINES lines and BUILD_TAIL_BYTES bytes, the newest kept; the lines
    of earlier steps and the builder's own notes are not the step's output."""
    many = [{"stream": f"line {n}\n"} for n in range(reploy.BUILD_TAIL_LINES + 5)]
    progress, shown = fed({"stream": "Step 1/2 : RUN a\n"}, {"stream": "early\n"},
                          {"stream": "Step 2/2 : RUN b"}, {"stream": "\n"},
                          {"stream": " ---> Running in 0123456789ab\n"}, *many,
                          {"stream": "Removing intermediate container 0123456789ab\n"},
                          {"error": "returned a non-zero code: 1", "errorDetail": {}})
    assert shown[:3] == ["Step 1/2 : RUN a", "early", "Step 2/2 : RUN b"]
    tail = progress.failure(progress.error or "").split("\n")
    assert tail[0] == "failed at Step 2/2 : RUN b: returned a non-zero code: 1; its last output:"
    assert tail[1:] == [f"  line {n}" for n in range(5, reploy.BUILD_TAIL_LINES + 5)]
    wide = [{"stream": f"{n:03} {'x' * 400}\n"} for n in range(reploy.BUILD_TAIL_LINES)]
    progress, _ = fed({"stream": "Step 1/1 : RUN c\n"}, *wide, {"error": "failed"})
    told = progress.failure("failed")
    assert len(told.split("\n", 1)[1].encode()) <= reploy.BUILD_TAIL_BYTES
    assert told.endswith(f"{reploy.BUILD_TAIL_LINES - 1:03} {'x' * 400}")


def test_the_stream_is_shown_in_lines_of_bounded_length() -> None:
    """The builder's colour codes around stderr are dropped; a pull's progress bars are not
    lines; a line that never ends is shown in pieces, never held whole."""
    endless = "y" * (10 * reploy.wire.MAX_SAFE_TEXT_BYTES)
    _, shown = fed({"stream": "\x1b[91mE: oops\n\x1b[0m"}, {"stream": "next\n"},
                   {"status": "Downloading", "id": "abc", "progress": "[=>  ]",
                    "progressDetail": {"current": 1, "total": 9}},
                   {"status": "Pull complete", "id": "abc"},
                   *({"stream": endless[i:i + 100]} for i in range(0, len(endless), 100)))
    assert shown[:3] == ["E: oops", "next", "abc Pull complete"]
    assert "".join(shown[3:]) == endless
    assert all(len(line.encode()) <= reploy.wire.MAX_SAFE_TEXT_BYTES for line in shown)
