"""serve's bytecode of agent.py (compile_agent_bytecode) and what the agent does with it (own_code),
without Docker: an interpreter imports the agent beside a copy of that bytecode, as a session's does."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import reploy_serve

IMPORT_AGENT = "import sys; sys.path.insert(0, sys.argv[1]); import agent; "


def agent_beside(tmp_path: Path, bytecode_dir: Path, source: bytes) -> Path:
    """A directory holding agent.py (`source`) and a copy of bytecode_dir as its __pycache__."""
    directory = tmp_path / "opt"
    directory.mkdir()
    (directory / "agent.py").write_bytes(source)
    shutil.copytree(bytecode_dir, directory / "__pycache__")
    return directory


def run(directory: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-S", "-B", "-v", "-c", IMPORT_AGENT + code, str(directory)],
                          capture_output=True, text=True, timeout=120, check=True)


def test_the_bytecode_is_made_once_writable_by_its_owner_only_and_taken_for_its_source(tmp_path: Path) -> None:
    bytecode_dir = tmp_path / "bytecode"
    reploy_serve.compile_agent_bytecode(bytecode_dir)
    [compiled] = bytecode_dir.iterdir()  # nothing staged is left beside it
    assert stat.S_IMODE(bytecode_dir.stat().st_mode) == 0o755 and stat.S_IMODE(compiled.stat().st_mode) == 0o644
    source = reploy_serve.AGENT_SOURCE.read_bytes()
    assert compiled.read_bytes().startswith(reploy_serve.agent_role.bytecode_header(source))
    written = compiled.stat().st_mtime_ns
    reploy_serve.compile_agent_bytecode(bytecode_dir)  # up to date: left alone
    assert compiled.stat().st_mtime_ns == written
    directory = agent_beside(tmp_path, bytecode_dir, source)
    proc = run(directory, "import json; print(json.dumps(agent.own_code()[:16].hex()))")
    assert f"code object from '{directory}/__pycache__/{compiled.name}'" in proc.stderr
    # The zygote's sealed copy is that same bytecode.
    assert json.loads(proc.stdout) == compiled.read_bytes()[:16].hex()


def test_a_changed_source_is_compiled_and_its_stale_bytecode_replaced(tmp_path: Path) -> None:
    bytecode_dir = tmp_path / "bytecode"
    reploy_serve.compile_agent_bytecode(bytecode_dir)
    [compiled] = bytecode_dir.iterdir()
    changed = reploy_serve.AGENT_SOURCE.read_bytes() + b"\n# changed\n"
    directory = agent_beside(tmp_path, bytecode_dir, changed)
    proc = run(directory, "print(agent.own_code() == open(agent.__file__, 'rb').read())")
    assert f"code object from '{directory}/__pycache__/" not in proc.stderr  # compiled from the source
    assert proc.stdout.strip() == "True"  # the zygote gets that source, not another one's bytecode
    compiled.write_bytes(b"\0" * 16 + compiled.read_bytes()[16:])  # another source's header
    reploy_serve.compile_agent_bytecode(bytecode_dir)
    assert compiled.read_bytes().startswith(
        reploy_serve.agent_role.bytecode_header(reploy_serve.AGENT_SOURCE.read_bytes()))
