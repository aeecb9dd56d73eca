"""Controlled sessions exact on every image and every edge (issue 23), on the real engine.

- Every container runs exactly the command Reploy chose, whatever its image's ENTRYPOINT, CMD
  and HEALTHCHECK: as workload and controller (with the strict consumer), and as a managed
  session (a real `serve`).
- The derived controller image puts the client first on PATH; the probe runs the installed
  client and refuses, by name, an image that cannot run it, and an engine that did not give
  the sandbox asked for (a relay of the test's own in front of the real engine creates the
  probe as a differently configured engine would) or that is not local.
- Staged-only edits of a built deployment change nothing a session or serve runs with.
- A signal during startup and during the acknowledgement wait; nothing after `terminated`.
- An existing output directory is used as it is.
- Output finalization is decided from what happened before its deadline: the host is
  suspended (SIGSTOP) at each of its waits and resumed past the deadline.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import contract_rules as rules
import reploy
from conftest import LABEL_RUN, ROOT, SERVE_STATE_DIR_PREFIX, stage_and_build
from serve_harness import ServeProcess
from test_conformance_matrix import (  # noqa: F401  (fixtures: matrix, runs)
    LABEL_ROLE, Run, assert_nothing_left, build_controller, matrix, runs, start,
)
from test_controlled_session_failures import CONTROLLER_UID_GID, MOMENT_TIMEOUT_S

pytestmark = pytest.mark.docker

#: An image's own ENTRYPOINT, CMD and HEALTHCHECK: were any of them used, the container would
#: run `python3 -c 'raise SystemExit(99)' ...` (exit 99 at once) or the image's health check.
HOSTILE_PYTHON_IMAGE = """\
FROM reploy-base/python:bookworm-1
ENTRYPOINT ["python3", "-c", "raise SystemExit(99)"]
CMD ["image-cmd"]
HEALTHCHECK --interval=1s CMD ["python3", "-c", "raise SystemExit(1)"]
"""
HOSTILE_SHELL_IMAGE = """\
FROM reploy-base/busybox:1
ENTRYPOINT ["/bin/sh", "-c", "exit 99"]
CMD ["image-cmd"]
HEALTHCHECK --interval=1s CMD ["/bin/sh", "-c", "exit 1"]
"""
RUNTIME_BLUEPRINT = """\
name: {name}
build:
  context: context
environment:
  runtime:
    user: "1000:1000"
    writable_paths: [/tmp]
    memory_mib: 256
    pids: 128
"""
#: What the staged blueprints are edited into after the build: nothing of it may count.
STAGED_RUNTIME = ('user: "1000:1000"', 'user: "0:0"'), ("memory_mib: 256", "memory_mib: 1024"), \
    ("pids: 128", "pids: 512"), ("writable_paths: [/tmp]", "writable_paths: [/tmp, /etc]")


def stage_deployment(base: Path, name: str, dockerfile: str, blueprint: str,
                     files: Optional[dict[str, str]] = None) -> Path:
    source = base / f"{name}-source"
    (source / "context").mkdir(parents=True)
    (source / "context/Dockerfile").write_text(dockerfile)
    for file_name, text in (files or {}).items():
        (source / "context" / file_name).write_text(text)
    (source / "blueprint.yaml").write_text(blueprint)
    stage_and_build(source / "blueprint.yaml", base / name)
    return base / name


def edit_staged(directory: Path, *edits: tuple[str, str]) -> None:
    """Change the staged blueprint only (no rebuild): the built generation stays the authority."""
    blueprint = directory / "blueprint.yaml"
    text = blueprint.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    blueprint.write_text(text)


def assert_exact_container(info: dict[str, Any], command: list[str],
                           user: str = "1000:1000") -> None:
    """The container runs `command` and nothing of its image's: no CMD, no health check; with
    the built generation's runtime (never the staged edits) as `user`."""
    config, host = info["Config"], info["HostConfig"]
    assert config["Entrypoint"] == command and not config["Cmd"], config
    assert config["Healthcheck"]["Test"] == ["NONE"]  # the image's check never runs
    assert config["User"] == user
    assert host["Memory"] == 256 * 1024 * 1024 and host["PidsLimit"] == 128
    assert set(host["Tmpfs"]) == {"/mnt/reploy-home", "/tmp"}


# ---------------------------------------------------------------------------------------------
# Exactly Reploy's command, whatever the image says; the client on PATH; staged edits ignored
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A controller and a workload whose images set ENTRYPOINT, CMD and HEALTHCHECK (and the
    controller a PATH without /usr/local/bin), built, then their staged blueprints edited."""
    base = tmp_path_factory.mktemp("hostile")
    controller = build_controller(
        base, "hostile-controller", HOSTILE_PYTHON_IMAGE + "ENV PATH=/usr/bin:/bin\n"
        "COPY strict_consumer.py /opt/controller/\n")
    edit_staged(controller, ('user: "1000:1000"', 'user: "0:0"'))
    workload = stage_deployment(base, "hostile-workload", HOSTILE_SHELL_IMAGE,
                                RUNTIME_BLUEPRINT.format(name="hostile-workload"))
    edit_staged(workload, *STAGED_RUNTIME)
    return {"controller": controller, "workload": workload}


def test_hostile_images_run_exactly_the_commands_reploy_chose(
        docker_engine: Any, hostile: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """The workload runs /bin/sh, the controller its declared command (which starts
    `reploy-session-client` by name: the derived image's PATH has it), the session ends ok."""
    run = start(runs, hostile["controller"], hostile["workload"], tmp_path / "out",
                "hold-then-exit")
    run.wait_moment("active")
    containers = {labels[LABEL_ROLE]: cid for cid, labels in run.manifest().containers.items()}
    assert set(containers) == {"controller", "workload"}
    workload = docker_engine.api.inspect_container(containers["workload"])
    assert_exact_container(workload, ["/bin/sh"])
    controller = docker_engine.api.inspect_container(containers["controller"])
    config = controller["Config"]
    assert config["Entrypoint"] == ["python3", "/opt/controller/strict_consumer.py",
                                    "hold-then-exit"] and not config["Cmd"]
    assert config["Healthcheck"]["Test"] == ["NONE"] and config["User"] == "1000:1000"
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in config["Env"]  # the client first on PATH
    run.answer()
    exit_code, result, stderr = run.finish()
    events = run.events()
    assert [e["type"] for e in events] == ["broker-ready", "opened", "ready", "workload-exit",
                                           "terminating", "workload-outputs-finalized",
                                           "terminated"]
    assert exit_code == 0 and result["ok"] is True, (result, stderr[-2000:])


def test_a_managed_session_runs_exactly_the_agent_with_the_built_runtime(
        docker_engine: Any, tmp_path: Path) -> None:
    """serve's container runs agent.py whatever the image's ENTRYPOINT, CMD and HEALTHCHECK,
    with the runtime of the generation it runs (uid, limits, writable paths), not the staged
    blueprint's."""
    workload = stage_deployment(tmp_path, "hostile-managed", HOSTILE_PYTHON_IMAGE,
                                RUNTIME_BLUEPRINT.format(name="hostile-managed"))
    edit_staged(workload, *STAGED_RUNTIME)
    state_dir = Path(tempfile.mkdtemp(prefix=SERVE_STATE_DIR_PREFIX)) / "state"
    server = ServeProcess(state_dir, workload)
    try:
        session = server.api.create("exact")
        ran = server.api.call("POST", f"/sessions/{session['id']}/exec",
                              {"argv": ["sh", "-c", "id -u; id -g"]})
        assert ran["exitCode"] == 0 and ran["stdout"] == "1000\n1000\n", ran
        [container] = docker_engine.api.containers(filters={"label": [
            f"{LABEL_RUN}={session['id']}"]})
        info = docker_engine.api.inspect_container(container["Id"])
        # The agent is root in its container and runs the workload as the built runtime user.
        assert_exact_container(info, info["Config"]["Entrypoint"], user="0:0")
        # agent.py imported (from serve's bytecode, when the versions match) under -I -S, then `serve`.
        assert info["Config"]["Entrypoint"][:6] == [
            "python3", "-I", "-S", "-c",
            "import sys; sys.path.insert(0, '/opt/reploy'); import agent; sys.exit(agent.main())", "serve"]
        assert info["Config"]["Entrypoint"][-2:] == ["--runtime-user", "1000:1000"]
    finally:
        server.api.delete_all()
        server.stop()
        shutil.rmtree(state_dir.parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The probe: an image that cannot run the client is refused, saying why
# ---------------------------------------------------------------------------------------------

CONSUMER_IMAGE = "FROM reploy-base/python:bookworm-1\nCOPY strict_consumer.py /opt/controller/\n"


@pytest.mark.parametrize("name, dockerfile, interpreter, detail", [
    ("no-env", "RUN rm /usr/bin/env\n", "python3",
     "exec /usr/local/bin/reploy-session-client: no such file or directory"),
    ("python-elsewhere", "RUN rm /usr/bin/python3\n", "python3.11",
     "the probe exited with code 127: /usr/bin/env: "),  # then env's quoted python3 not found
])
def test_a_controller_image_the_client_cannot_run_in_is_refused_by_name(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run],
        name: str, dockerfile: str, interpreter: str, detail: str) -> None:
    """Without /usr/bin/env, `python3 -c ...` worked (the old probe passed) and the session
    failed at run time; now the probe runs the installed client as the controller would."""
    controller = build_controller(tmp_path, name, CONSUMER_IMAGE + dockerfile
                                  + f"LABEL io.reploy.test.unique={tmp_path.name}\n",
                                  interpreter=interpreter)
    run = start(runs, controller, matrix["workload"], tmp_path / "out", "exit 0")
    exit_code, result, _ = run.finish()
    assert exit_code == 1 and result["error"].startswith(f"plan rejected: {reploy.CLIENT_NEEDS}")
    assert detail in result["error"] and "no such file or directory" in result["error"].lower(), \
        result["error"]
    assert result["session_result"] is None
    assert not list((matrix["workload"] / ".reploy/watchdog").glob("*.json"))


# ---------------------------------------------------------------------------------------------
# The engine: a differently configured one is refused by the probe, a remote one at once
# ---------------------------------------------------------------------------------------------


def engine_socket_path() -> str:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    assert host.startswith("unix://"), host
    return host[len("unix://"):]


class EngineRelay:
    """The real local engine behind the test's own listener (a unix socket or a loopback TCP
    port). Requests pass through unchanged except container creations, which `rewrite` may
    change as an engine configured otherwise would create the container. Responses pass raw."""

    def __init__(self, listener: socket.socket, rewrite: Callable[[dict[str, Any]], None]) -> None:
        self.listener = listener
        self.rewrite = rewrite
        self.rewritten = 0
        self.sockets: list[socket.socket] = [listener]
        listener.listen(16)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(engine_socket_path())
            self.sockets += [client, upstream]
            threading.Thread(target=self.pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self.requests, args=(client, upstream), daemon=True).start()

    @staticmethod
    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with_shutdown(sock)

    def requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """One HTTP/1.1 request after another (Content-Length bodies); a hijacked or chunked
        one turns the connection into a raw pump."""
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = client.recv(65536)
                    if not data:
                        return with_shutdown(upstream)
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:])}
                if "content-length" not in headers or "upgrade" in headers:
                    upstream.sendall(head + b"\r\n\r\n" + buffer)
                    return self.pump(client, upstream)
                length = int(headers["content-length"])
                while len(buffer) < length:
                    buffer += client.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                method, path = lines[0].split(" ")[:2]
                if method == "POST" and path.split("?")[0].endswith("/containers/create"):
                    document = json.loads(body)
                    self.rewrite(document)
                    self.rewritten += 1
                    body = json.dumps(document).encode()
                    lines = [line for line in lines if not line.lower().startswith(
                        "content-length:")] + [f"Content-Length: {len(body)}"]
                    head = "\r\n".join(lines).encode("latin-1")
                upstream.sendall(head + b"\r\n\r\n" + body)
        except OSError:
            pass

    def close(self) -> None:
        for sock in self.sockets:
            with_shutdown(sock)
            sock.close()


def with_shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def add_security_opt(option: str) -> Callable[[dict[str, Any]], None]:
    return lambda document: document["HostConfig"]["SecurityOpt"].append(option)


def drop_no_new_privileges(document: dict[str, Any]) -> None:
    document["HostConfig"]["SecurityOpt"].remove("no-new-privileges:true")


def add_capability(document: dict[str, Any]) -> None:
    document["HostConfig"]["CapAdd"] = ["NET_RAW"]


@pytest.mark.parametrize("rewrite, reason", [
    (add_security_opt("seccomp=unconfined"), "Seccomp is '0', not '2'"),
    (drop_no_new_privileges, "NoNewPrivs is '0', not '1'"),
    (add_capability, "CapBnd is '0000000000002000', not '0000000000000000'"),
], ids=["seccomp-unconfined", "new-privileges", "a-capability"])
def test_the_probe_fails_closed_on_an_engine_that_did_not_give_the_sandbox(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path,
        rewrite: Callable[[dict[str, Any]], None], reason: str) -> None:
    """The probe's container reads its own /proc/self/status: an engine whose containers
    run unconfined, keep a capability or may gain privileges is refused, whatever it says."""
    controller = build_controller(tmp_path, "probed", CONSUMER_IMAGE
                                  + f"LABEL io.reploy.test.unique={tmp_path.name}\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "engine.sock"))
    relay = EngineRelay(listener, rewrite)
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
             "--controller-dir", str(controller), "--workload-dir", str(matrix["workload"]),
             "--", "consume", "exit", "0"], capture_output=True, timeout=300,
            env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path / 'engine.sock'}"})
    finally:
        relay.close()
    result = rules.check_reploy_result_line(proc.stdout)
    assert proc.returncode == 1 and relay.rewritten == 1, proc.stderr.decode()[-2000:]
    assert result["error"].startswith("plan rejected: the probe of the controller image failed "
                                      "closed: the engine did not give it the sandbox asked for")
    assert reason in result["error"], result["error"]
    assert not docker_engine.api.containers(all=True, filters={"label": [
        f"{LABEL_ROLE}=python-probe", f"io.reploy.session.workload-dir={matrix['workload']}"]})


def test_an_engine_not_reached_through_a_local_unix_socket_is_refused(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    relay = EngineRelay(listener, lambda document: None)
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
             "--controller-dir", str(matrix["consumer"]), "--workload-dir", str(matrix["workload"]),
             "--", "consume", "exit", "0"], capture_output=True, timeout=300,
            env={**os.environ, "DOCKER_HOST": f"tcp://127.0.0.1:{listener.getsockname()[1]}"})
    finally:
        relay.close()
    result = rules.check_reploy_result_line(proc.stdout)
    assert proc.returncode == 1 and relay.rewritten == 0  # refused before any container
    assert result["error"] == (
        "plan rejected: refusing this Docker engine: it is not reached through a local unix "
        "socket (a remote engine cannot share this host's files and sockets)"), result["error"]


# ---------------------------------------------------------------------------------------------
# Signals during startup and during the acknowledgement wait; nothing after terminated
# ---------------------------------------------------------------------------------------------


def test_a_signal_during_startup_cancels_it_and_nothing_follows_terminated(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """SIGTERM while the host waits for the attachment: host-cancel, terminated, and the
    controller acknowledges after the broker's 10 s attach deadline would have passed; no
    client-error follows terminated, the acknowledgement reaches the host, 143."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "late-ack",
                "--result-acknowledgement-timeout", "45s")
    run.wait_moment("broker-ready")
    run_id = run.run_id()
    run.proc.send_signal(signal.SIGTERM)
    exit_code, result, _ = run.finish()
    events = run.events()
    assert [e["type"] for e in events] == ["broker-ready", "opened", "terminated"]
    assert exit_code == 143 and result["error"] == "cancelled by SIGTERM"
    assert result["session_result"]["cause"] == "host-cancel"
    assert result["result_acknowledged"] is True and run.consumer()["client_exit"] == 0
    assert_nothing_left(docker_engine, matrix["workload"], run_id)


@pytest.mark.parametrize("answer, code", [("no-ack", 143), ("ack", 0)])
def test_a_signal_during_the_acknowledgement_wait(docker_engine: Any, matrix: dict[str, Path],
                                                  tmp_path: Path, runs: list[Run], answer: str,
                                                  code: int) -> None:
    """The session already ended (terminated is out): a SIGTERM changes none of its facts, but
    a result that is not ok exits 143 (it exited 1) and its error names the signal; an ok one
    exits 0."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "ack-wait",
                "--result-acknowledgement-timeout", "5s")
    run.wait_moment("terminated")
    run.proc.send_signal(signal.SIGTERM)
    run.answer(answer)
    exit_code, result, _ = run.finish()
    assert exit_code == code
    assert result["session_result"]["cause"] == "workload-exit"
    if answer == "ack":
        assert result["ok"] is True and result["error"] is None
    else:
        assert result["error"] == "the controller did not acknowledge the result; received SIGTERM"


# ---------------------------------------------------------------------------------------------
# An existing output directory is used as it is
# ---------------------------------------------------------------------------------------------


def test_an_existing_output_dir_keeps_its_owner_and_mode(docker_engine: Any,
                                                         matrix: dict[str, Path], tmp_path: Path,
                                                         runs: list[Run]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 0, CONTROLLER_UID_GID[1])
    out.chmod(0o2770)  # the controller writes it through its group
    run = start(runs, matrix["consumer"], matrix["workload"], out, "exit 0")
    exit_code, result, _ = run.finish()
    assert exit_code == 0 and result["controller_output"] == {"kind": "directory-retained"}
    assert (out / "events.jsonl").stat().st_size > 0  # the controller wrote it
    info = out.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (0, 1000, 0o2770)


# ---------------------------------------------------------------------------------------------
# Output finalization is decided before its deadline: the host suspended at each of its waits
# ---------------------------------------------------------------------------------------------

#: Past the 30 s output-finalization deadline: the scenario is the host being away that long.
SUSPENDED_S = 31


def suspend_host(run: Run, meanwhile: Callable[[], None] = lambda: None) -> None:
    """SIGSTOP the host, do `meanwhile`, SIGCONT it SUSPENDED_S after it stopped."""
    run.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        meanwhile()
        # Not synchronisation: the scenario is the host being away past the deadline.
        time.sleep(max(0.0, stopped_at + SUSPENDED_S - time.monotonic()))
    finally:
        run.proc.send_signal(signal.SIGCONT)
    assert time.monotonic() - stopped_at >= SUSPENDED_S


def wait_stderr(run: Run, text: bytes) -> None:
    """Until the host said `text` on stderr (what it said is kept for the end)."""
    assert run.proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while text not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, seen[-2000:]
        if select.select([run.proc.stderr], [], [], remaining)[0]:
            chunk = os.read(run.proc.stderr.fileno(), 65536)
            assert chunk, seen[-2000:]
            seen += chunk


def assert_finalization_failed_at_the_deadline(run: Run, cause: str, reason: str) -> None:
    exit_code, result, _ = run.finish()
    events = run.events()  # in order: nothing but terminated after outputs-finalized
    finalized = next(e for e in events if e["type"] == "workload-outputs-finalized")
    assert finalized["status"] == "failed" and finalized["reason"] == reason, finalized
    status = result["session_result"]["workload_output_finalization_status"]
    assert status == {"kind": "failed", "reason": reason}
    assert result["session_result"]["cause"] == cause
    assert exit_code == 1 and result["ok"] is False
    assert result["error"] == f"terminal output finalization failed: {reason}"


NO_END_OF_FILE = "terminal output did not reach end of file within 30 s of termination"


def test_a_host_resumed_past_the_deadline_in_its_termination_grace_reports_failed(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """The host is stopped while it waits out the termination grace; the workload exits and
    its output ends meanwhile. Resumed past the deadline, what it then sees is late."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "exit-later",
                "--termination-grace", "20s")
    run.wait_moment("terminating")
    suspend_host(run)
    assert_finalization_failed_at_the_deadline(run, "controller-terminate", NO_END_OF_FILE)


def test_a_host_resumed_past_the_deadline_while_delivering_reports_failed(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """The workload wrote more than the stopped attachment's socket holds and exited: the host
    has all of it, to the end of file, but some still queued, and waits to deliver it. It is
    stopped; the attachment resumes and empties the socket; resumed past the deadline, the
    host delivers the rest in its first pass. That came after the deadline: failed (it was
    reported drained)."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "burst")
    run.wait_moment("terminating")
    suspend_host(run, meanwhile=run.answer)  # the controller resumes its attachment meanwhile
    assert_finalization_failed_at_the_deadline(
        run, "workload-exit", "terminal output could not be delivered to the attachment in time")


def test_a_host_resumed_past_the_deadline_while_draining_reports_failed(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """The host is stopped while it drains the PTY (after the grace and SIGKILL) toward an
    attachment that is stopped too; resumed past the deadline, it reports failed."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "stalled-flood",
                "--termination-grace", "100ms")
    run.wait_moment("terminating")
    wait_stderr(run, b"sending SIGKILL")  # from here on the host is in the drain's wait
    suspend_host(run)
    assert_finalization_failed_at_the_deadline(run, "controller-terminate", NO_END_OF_FILE)
