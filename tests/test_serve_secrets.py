"""What the runtime user can reach in a managed session's container, on the real engine:
`--agent-env` values are in no process it can read (/proc/*/environ, cmdline) and no file it
can read, outside the agent CLI's own runs; every process it runs has no capability, the bounding
set included; a prompt on the CLI's stdin is a read-only fd it cannot give a name to."""

from __future__ import annotations

import base64
import json
from typing import Any, Callable

import pytest

from serve_harness import ROOT, ServeProcess, managed_workload, serve_factory  # noqa: F401  (fixtures)

pytestmark = pytest.mark.docker
SECRET = "credential-7c41d09e5ab2f3"
CAP_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
NO_CAPABILITIES = dict.fromkeys(CAP_FIELDS, "0" * 16)

#: Run as the runtime user through exec, the secret on stdin (so in neither its own environ nor
#: its cmdline). A control process holding the secret in its environment shows the scan sees
#: the runtime user's processes (and is the only hit). Files: every mount but /proc and /sys, regular files only (the
#: root file system is the image, read-only: nothing is written there at run time).
SCAN = r'''
import json, os, stat, subprocess, sys
needle = sys.stdin.buffer.read()
control = subprocess.Popen([sys.executable, "-c", "print(flush=True); import time; time.sleep(600)"],
                           env={"CONTROL": needle.decode()}, stdout=subprocess.PIPE)
control.stdout.readline()  # it runs: its environment is in place (not yet while execve is under way)
me = os.getuid()
report = {"hits": [], "environs": [], "caps": {}, "files": 0}
try:
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(l.split(":\t", 1) for l in f.read().splitlines() if ":\t" in l)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == me:
            report["caps"][pid] = {k: status[k].strip() for k in %(fields)r}
        if needle in cmdline:
            report["hits"].append([pid, "cmdline"])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        report["environs"].append([pid, cmdline.decode(errors="replace")])
        if needle in environ:
            report["hits"].append([pid, "environ"])
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4] for line in f}
    for mount in sorted(mounts - {"/"}):
        if mount.startswith(("/proc", "/sys")):
            continue
        for root, dirs, files in os.walk(mount):
            for name in files:
                path = os.path.join(root, name)
                try:
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        continue
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                report["files"] += 1
                if needle in data:
                    report["hits"].append([path, "file"])
finally:
    control.kill()
    control.wait()
report["control"] = control.pid
print(json.dumps(report))
''' % {"fields": CAP_FIELDS}


def scan(server: ServeProcess, sid: str) -> dict[str, Any]:
    result = server.api.call("POST", f"/sessions/{sid}/exec", {
        "argv": ["python3", "-c", SCAN], "stdinBase64": base64.b64encode(SECRET.encode()).decode()})
    assert result["exitCode"] == 0, result
    return json.loads(result["stdout"])


def test_no_process_or_file_of_the_runtime_user_holds_the_agent_env_and_none_keeps_a_capability(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--agent-env", "FAKE_SECRET", env={"FAKE_SECRET": SECRET})
    api = server.api
    for workload in ("claude-code", "shell"):
        sid = api.create(workload, workload)["id"]
        if workload == "claude-code":  # the secret does reach the CLI's runs, where it is needed
            api.call("POST", f"/sessions/{sid}/message", {"text": "secret"})
            api.wait_output(sid, b"err:[REDACTED]")
        api.call("GET", f"/sessions/{sid}/list/")  # the file workers' zygote starts
        report = scan(server, sid)
        assert report["hits"] == [[report["control"], "environ"]], report
        zygotes = [pid for pid, cmdline in report["environs"] if "zygote" in cmdline]
        assert len(zygotes) == 1 and report["files"] > 0
        assert report["caps"] and all(caps == NO_CAPABILITIES for caps in report["caps"].values()), report["caps"]
        assert str(zygotes[0]) in report["caps"]
        if workload == "claude-code":
            api.call("POST", f"/sessions/{sid}/message", {"text": "probe ".ljust(200 * 1024, "p")})
            [line] = [line for line in api.wait_output(sid, b"}}\n").decode().splitlines() if '"caps"' in line]
            probe = json.loads(line)
            assert probe["via"] == "stdin" and probe["stdin"] == "read-only" and probe["link"] != "linked"
            assert probe["caps"] == NO_CAPABILITIES


def test_as_root_without_setpcap_the_agent_refuses_to_start(docker_engine: Any) -> None:
    """The bounding set can only be emptied with CAP_SETPCAP: an agent that lacks it (a container
    keeping only SETUID, SETGID and KILL) starts no workload at all, and says why."""
    container = docker_engine.containers.create(
        "reploy-base/python:bookworm-1", ["python3", "/opt/reploy/agent.py", "serve", "--session-dir", "/tmp/s",
                                          "--workload", "shell", "--runtime-user", "1000:1000"],
        user="0:0", cap_drop=["ALL"], cap_add=["SETUID", "SETGID", "KILL", "CHOWN"],
        security_opt=["no-new-privileges:true"], network_mode="none",
        volumes={str(ROOT / "agent.py"): {"bind": "/opt/reploy/agent.py", "mode": "ro"}})
    try:
        container.start()
        assert container.wait(timeout=60)["StatusCode"] == 1
        assert b"needs CAP_SETPCAP" in container.logs()
    finally:
        container.remove(force=True)
