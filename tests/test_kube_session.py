"""reploy_kube on the real cluster of scripts/kube-cluster.sh: a session Pod from the builder with the managed example
image, its agent reached through one long-lived exec (AgentChannel), the sandbox read from inside, the channel
surviving a dropped stream, and nothing left in the namespace. No kubectl: every call is reploy_kube's own.

Without a cluster these tests skip, unless REPLOY_REQUIRE_KUBERNETES=1 (CI): then it is a failure. Figures (calls
per second over one channel against one exec per call) are printed with -s; nothing is asserted about speed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reploy_kube as kube  # noqa: E402
import reploy_serve  # noqa: E402  (the agent's command and mounts, as serve gives them to a Docker container)
from reploy import CONTAINER_HOME, Runtime  # noqa: E402

from kube_fixture import KubeCluster, kube_script, wait_until  # noqa: E402

pytestmark = [pytest.mark.kubernetes, pytest.mark.docker]

VERB_TIMEOUT_S = 600.0
POD_RUNNING_S = 180.0
#: The managed example's runtime (examples/managed/managed.blueprint.yaml).
RUNTIME = Runtime(uid=1000, gid=1000, writable_paths=("/tmp",), memory_mib=256, pids=128)
SERVE_ID = "test-kube-session"
SESSION_ID = "5e55101d0c0ffee0"


def managed_image() -> str:
    """The managed example, staged and built on the machine's engine (cached when built before)."""
    with tempfile.TemporaryDirectory(prefix="reploy-kube-") as directory:
        for verb in (["stage", str(ROOT / "examples/managed/managed.blueprint.yaml")], ["build"]):
            done = subprocess.run([sys.executable, str(ROOT / "reploy.py"), *verb, "--dir", f"{directory}/d"],
                                  capture_output=True, text=True, timeout=VERB_TIMEOUT_S)
            assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])["generation"]["reference"]


def agent_files() -> dict[str, bytes]:
    """agent.py and its bytecode, as serve mounts them into a Docker session (compile_agent_bytecode)."""
    with tempfile.TemporaryDirectory() as directory:
        reploy_serve.compile_agent_bytecode(Path(directory))
        files = {f"__pycache__/{path.name}": path.read_bytes() for path in Path(directory).iterdir()}
    return {"agent.py": reploy_serve.AGENT_SOURCE.read_bytes(), **files}


@dataclass(frozen=True)
class Namespace:
    """The test run's namespace of the cluster (kube_fixture's), reached with reploy_kube's own client."""

    name: str
    api: kube.KubeApi


@pytest.fixture(scope="module")
def namespace(kube_cluster: KubeCluster) -> Namespace:
    return Namespace(kube_cluster.namespace, kube.KubeApi(kube.load_kubeconfig(kube_cluster.kubeconfig)))


class Session:
    def __init__(self, namespace: Namespace, pod: str, channel: kube.AgentChannel, config_map: str) -> None:
        self.namespace = namespace
        self.config_map = config_map
        self.api = namespace.api
        self.pod = pod
        self.channel = channel

    def result(self, method: str, **params: Any) -> dict[str, Any]:
        answer = self.channel.call(method, params)
        assert "result" in answer, answer
        return answer["result"]

    def run(self, argv: list[str]) -> dict[str, Any]:
        """An exec through the agent, as the workload's runtime user, long-polled to its end."""
        exec_id = self.result("exec", argv=argv)["exec_id"]
        out = {"stdout": b"", "stderr": b""}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            page = self.result("exec_wait", exec_id=exec_id, wait_ms=2000, release=True,
                               stdout_offset=len(out["stdout"]), stderr_offset=len(out["stderr"]))
            for name in out:
                out[name] += base64.b64decode(page[f"{name}_b64"])
            if not page["running"] and all(len(out[name]) == page[f"{name}_bytes"] for name in out):
                return {**page, **out}
        pytest.fail(f"exec {argv} did not end")


def pod_phase(api: kube.KubeApi, namespace: str, pod: str) -> Any:
    status = api.get(kube.Resource.PODS, namespace, pod).get("status", {})
    failure = kube.pod_failure(status)
    if failure is not None:
        pytest.fail(f"the session Pod will not run: {failure}")
    return kube.pod_ready(status)


@pytest.fixture(scope="module")
def session(namespace: Namespace) -> Iterator[Session]:
    image = managed_image()
    loaded = kube_script("load", image, timeout_s=VERB_TIMEOUT_S)
    assert loaded.returncode == 0, loaded.stderr
    api, ns = namespace.api, namespace.name
    config_map = kube.agent_config_map(agent_files(), SERVE_ID)
    api.create(kube.Resource.CONFIG_MAPS, ns, config_map)
    api.create(kube.Resource.NETWORK_POLICIES, ns, kube.sessions_network_policy(SERVE_ID))
    command = (*reploy_serve.AGENT_COMMAND, "serve", "--session-dir", reploy_serve.SESSION_MOUNT,
               "--workload", "shell", "--home", CONTAINER_HOME, "--runtime-user", RUNTIME.user)
    spec = kube.SessionPodSpec(
        session_id=SESSION_ID, serve_id=SERVE_ID, image=image, pull_policy=kube.PullPolicy.NEVER,
        command=command, environment=(("HOME", CONTAINER_HOME), ("LANG", "C.UTF-8")), runtime=RUNTIME,
        cpu_millis=500, session_disk_mib=256, agent_config_map=config_map["metadata"]["name"],
        session_mount=reploy_serve.SESSION_MOUNT)
    pod = kube.session_pod(spec, config_map)
    name = pod["metadata"]["name"]
    created = api.create(kube.Resource.PODS, ns, pod)
    channel = None
    try:
        # The apiserver kept every sandbox field as written: nothing was dropped or defaulted away.
        for key, value in pod["spec"].items():
            if key not in ("initContainers", "containers", "volumes"):  # a false host* field is left out
                assert created["spec"].get(key, False if value is False else None) == value, key
        for kind in ("initContainers", "containers"):
            for made, asked in zip(created["spec"][kind], pod["spec"][kind], strict=True):
                for key in ("securityContext", "resources", "command", "volumeMounts", "imagePullPolicy"):
                    assert made[key] == asked[key], (kind, key)
        wait_until("the session Pod Running", lambda: pod_phase(api, ns, name), POD_RUNNING_S)
        channel = kube.AgentChannel(api, ns, name, kube.relay_command(reploy_serve.AGENT_COMMAND,
                                                                      reploy_serve.SESSION_MOUNT))
        wait_until("the agent to answer", lambda: _answers(channel), 60)
        yield Session(namespace, name, channel, config_map["metadata"]["name"])
    finally:
        if channel is not None:
            channel.close()
        for resource, kind_name in ((kube.Resource.PODS, name),
                                    (kube.Resource.CONFIG_MAPS, config_map["metadata"]["name"]),
                                    (kube.Resource.NETWORK_POLICIES,
                                     kube.sessions_network_policy(SERVE_ID)["metadata"]["name"])):
            try:
                api.delete(resource, ns, kind_name, grace_period_s=0 if resource is kube.Resource.PODS else None)
            except kube.KubeNotFound:
                pass


def _answers(channel: kube.AgentChannel) -> bool:
    try:
        return "result" in channel.call("status", {})
    except kube.AgentChannelError as e:
        if not e.retryable:
            raise
        return False


def test_status_over_the_channel(session):
    status = session.result("status")
    assert status["type"] == "status" and status["workload"] == "shell" and status["running"] is True


def test_write_then_read_shows_the_shell_output(session):
    start = session.result("status")["log_bytes"]
    session.result("write", data_b64=base64.b64encode(b"echo kube-$((6*7))\n").decode())
    seen = b""
    deadline = time.monotonic() + 20
    while b"kube-42" not in seen and time.monotonic() < deadline:
        page = session.result("read", offset=start + len(seen), wait_ms=2000)
        seen += base64.b64decode(page["data_b64"])
    assert b"kube-42" in seen


def test_the_workload_sandbox_read_from_inside(session):
    done = session.run(["cat", "/proc/self/status"])
    fields = dict(line.split(":\t", 1) for line in done["stdout"].decode().splitlines() if ":\t" in line)
    assert done["exit_code"] == 0
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    assert fields["Uid"].split() == ["1000"] * 4 and fields["Gid"].split() == ["1000"] * 4
    touched = session.run(["touch", "/x"])
    assert touched["exit_code"] != 0 and b"Read-only file system" in touched["stderr"]
    home = session.run(["sh", "-c", "touch $HOME/h /tmp/t && stat -c '%a %u' $HOME /tmp"])
    assert home["exit_code"] == 0 and home["stdout"].split(b"\n")[:2] == [b"700 1000", b"755 1000"]


PROCESSES_PROGRAM = """\
import os
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]
        name = open(f'/proc/{pid}/comm').read().strip()
    except OSError:
        continue
    print(pid, state, name)
"""


def processes(session: Session) -> list[tuple[str, str]]:
    """(state, name) of every process the session's container sees."""
    end, out, err = kube.exec_once(session.api, session.namespace.name, session.pod, kube.AGENT_CONTAINER,
                                   ("python3", "-c", PROCESSES_PROGRAM))
    assert end == kube.ExecEnd(0, ""), err
    return [tuple(line.split(" ", 2)[1:]) for line in out.decode().splitlines()]  # type: ignore[misc]


def test_what_the_workload_orphans_is_reaped(session):
    """The pause process is the Pod's init (shareProcessNamespace): orphans of the shell do not stay zombies."""
    session.result("write", data_b64=base64.b64encode(b"sh -c 'sleep 3 &'; sh -c 'sleep 3 &'\n").decode())
    wait_until("the orphaned sleeps to start", lambda: any(name == "sleep" for _, name in processes(session)), 20)
    wait_until("the orphaned sleeps to end", lambda: not any(name == "sleep" for _, name in processes(session)), 20)
    seen = processes(session)
    assert [state for state, _ in seen if state == "Z"] == [], seen
    assert ("S", "pause") in seen


def test_a_long_poll_shares_the_channel(session):
    """A read waiting at the log's end does not hold the calls behind it on the same stream."""
    for attempt in range(5):  # unless the shell prints meanwhile
        answers: list[str] = []
        offset = session.result("status")["log_bytes"]
        poll = threading.Thread(target=lambda: answers.append(
            "read" if session.result("read", offset=offset, wait_ms=4000)["length"] == 0 else "output"))
        poll.start()
        wait_until("the read to be in flight", lambda: session.channel.in_flight >= 1, 10)
        session.result("status")
        answers.append("status")
        poll.join(20)
        assert answers != ["read", "status"], "the status waited for the read's long-poll"
        if answers[0] == "status":
            return
    pytest.fail("the shell kept printing: no read waited")


def test_large_lines_both_ways(session):
    """A request line of 3 MiB (many WebSocket frames out) and answers of 256 KiB pages (many frames in)."""
    data = os.urandom(2 * 1024 * 1024)
    done = session.run(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x; cat > /dev/null"])
    assert done["exit_code"] == 0 and done["stdout"] == b"x" * 300000
    exec_id = session.result("exec", argv=["sha256sum"], stdin_b64=base64.b64encode(data).decode())["exec_id"]
    page = session.result("exec_wait", exec_id=exec_id, wait_ms=4000, release=True)
    while page["running"]:
        page = session.result("exec_wait", exec_id=exec_id, wait_ms=4000, release=True)
    assert base64.b64decode(page["stdout_b64"]).split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_replace_is_compare_and_swap_on_the_real_apiserver(namespace):
    api, ns = namespace.api, namespace.name
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cas"}, "data": {"n": "0"}}
    created = api.create(kube.Resource.CONFIG_MAPS, ns, body)
    try:
        with pytest.raises(kube.KubeAlreadyExists):
            api.create(kube.Resource.CONFIG_MAPS, ns, body)
        first = api.replace(kube.Resource.CONFIG_MAPS, ns, {**created, "data": {"n": "1"}})
        assert first["data"] == {"n": "1"}
        with pytest.raises(kube.KubeConflict):  # the version we read is gone
            api.replace(kube.Resource.CONFIG_MAPS, ns, {**created, "data": {"n": "2"}})
        assert api.get(kube.Resource.CONFIG_MAPS, ns, "cas")["data"] == {"n": "1"}
    finally:
        api.delete(kube.Resource.CONFIG_MAPS, ns, "cas")
    with pytest.raises(kube.KubeNotFound):
        api.get(kube.Resource.CONFIG_MAPS, ns, "cas")


def test_a_file_copied_in_and_out_of_the_agent_dir(session, capsys):
    """What a snapshot and a restore need: an archive out of a Pod into serve's store, and into a new Pod."""
    data = os.urandom(8 * 1024 * 1024)
    started = time.perf_counter()
    kube.copy_in(session.api, session.namespace.name, session.pod, reploy_serve.SESSION_MOUNT, "in.bin",
                 (data[i:i + 1000003] for i in range(0, len(data), 1000003)), len(data), deadline_s=60)
    copied_in = time.perf_counter() - started
    digest = hashlib.sha256()
    started = time.perf_counter()
    kube.copy_out(session.api, session.namespace.name, session.pod, reploy_serve.SESSION_MOUNT, "in.bin",
                  digest.update, max_bytes=len(data), deadline_s=60)
    copied_out = time.perf_counter() - started
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    with pytest.raises(kube.KubeError, match="File exists"):  # never over a file there
        kube.copy_in(session.api, session.namespace.name, session.pod, reploy_serve.SESSION_MOUNT, "in.bin",
                     [b"x"], 1, deadline_s=60)
    with pytest.raises(kube.WebSocketError, match="more output than"):
        kube.copy_out(session.api, session.namespace.name, session.pod, reploy_serve.SESSION_MOUNT, "in.bin",
                      digest.update, max_bytes=len(data) - 1, deadline_s=60)
    listing = session.run(["ls", "-l", f"{reploy_serve.SESSION_MOUNT}/agent/in.bin"])
    assert listing["exit_code"] != 0 and b"Permission denied" in listing["stderr"]  # the workload cannot see it
    with capsys.disabled():
        print(f"\n8 MiB into the agent dir in {copied_in:.2f} s, out in {copied_out:.2f} s")


def documented_role() -> dict[str, Any]:
    """The Role of docs/kubernetes-backend.md, as the page shows it."""
    page = (ROOT / "docs" / "kubernetes-backend.md").read_text()
    section = page.split("## The Role serve needs", 1)[1]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_documented_role_is_enough_and_no_more(namespace, session):
    """serve as a service account holding only the documented Role: its sessions' Pods and their agents, nothing
    else (the token path of the client, and the bearer header on a WebSocket exec, on the real apiserver)."""
    api, ns = namespace.api, namespace.name
    role = documented_role()
    role["metadata"]["namespace"] = ns
    account = f"/api/v1/namespaces/{ns}/serviceaccounts"
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
    api.request("POST", account, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "serve"}})
    try:
        api.request("POST", f"{rbac}/roles", role)
        api.request("POST", f"{rbac}/rolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "serve"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": "serve", "namespace": ns}]})
        secret = wait_until("the account's token", lambda: (api.request("GET", f"{account}/serve").get("secrets")
                                                           or [{}])[0].get("name"), 30)
        token = base64.b64decode(api.request("GET", f"/api/v1/namespaces/{ns}/secrets/{secret}")["data"]["token"])
        serve = kube.KubeApi(kube.ClusterAccess(server=api.access.server, ca=api.access.ca, token=token.decode()))
        assert session.pod in [pod["metadata"]["name"] for pod in serve.list(kube.Resource.PODS, ns)]
        channel = kube.AgentChannel(serve, ns, session.pod, kube.relay_command(reploy_serve.AGENT_COMMAND,
                                                                               reploy_serve.SESSION_MOUNT))
        try:
            assert "result" in channel.call("status", {})
        finally:
            channel.close()
        with pytest.raises(kube.KubeApiError) as refused:
            serve.request("GET", f"/api/v1/namespaces/{ns}/secrets")
        assert (refused.value.code, refused.value.reason) == (403, "Forbidden")
        with pytest.raises(kube.KubeApiError, match="Forbidden"):
            serve.request("GET", "/api/v1/namespaces/default/pods")
    finally:
        for path in (f"{rbac}/rolebindings/serve", f"{rbac}/roles/{role['metadata']['name']}", f"{account}/serve"):
            try:
                api.request("DELETE", path)
            except kube.KubeNotFound:
                pass


def test_channel_against_one_exec_per_call(session, capsys):
    calls = 50
    started = time.perf_counter()
    for _ in range(calls):
        session.result("status")
    channel_s = time.perf_counter() - started
    per_exec = 10
    argv = (*reploy_serve.AGENT_COMMAND, "call", reploy_serve.SESSION_MOUNT, "status")
    started = time.perf_counter()
    for _ in range(per_exec):
        end, out, _ = kube.exec_once(session.api, session.namespace.name, session.pod, kube.AGENT_CONTAINER, argv)
        assert end == kube.ExecEnd(0, "") and json.loads(out)["result"]["type"] == "status"
    exec_s = time.perf_counter() - started
    with capsys.disabled():
        print(f"\nagent calls: {calls / channel_s:.1f}/s over one channel ({channel_s / calls * 1000:.1f} ms each); "
              f"{per_exec / exec_s:.2f}/s with one exec per call ({exec_s / per_exec * 1000:.0f} ms each); "
              f"ratio {channel_s / calls / (exec_s / per_exec):.3f}")


def test_the_channel_survives_a_dropped_stream(session):
    assert "result" in session.channel.call("status", {})
    opened = session.channel.opened
    # The relay runs as the container's root: only another exec (never the workload) can end it.
    assert relays(session, kill=True) == 1
    wait_until("the channel to see its stream end", lambda: not session.channel.connected, 30)
    assert "result" in session.channel.call("status", {})
    assert session.channel.opened == opened + 1


def relays(session: Session, kill: bool = False) -> int:
    """How many `agent.py relay` processes run in the session's container; with kill, SIGKILLed. The relay runs as
    the container's root: only another exec (never the workload) can end it."""
    program = ("import os, signal, sys\n"
               "found = 0\n"
               "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
               "    try: argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
               "    except OSError: continue\n"
               "    if b'relay' in argv and int(pid) != os.getpid():\n"
               "        found += 1\n"
               "        if sys.argv[1] == 'kill': os.kill(int(pid), signal.SIGKILL)\n"
               "print(found)\n")
    end, out, err = kube.exec_once(session.api, session.namespace.name, session.pod, kube.AGENT_CONTAINER,
                                   ("python3", "-c", program, "kill" if kill else "count"))
    assert end == kube.ExecEnd(0, ""), err
    return int(out)


def test_a_closed_channel_ends_its_relay(session):
    assert "result" in session.channel.call("status", {})
    assert relays(session) == 1
    session.channel.close()
    wait_until("the relay to see its stdin end and exit", lambda: relays(session) == 0, 30)


def test_an_exec_that_fails_reports_its_exit_code(session):
    end, out, err = kube.exec_once(session.api, session.namespace.name, session.pod, kube.AGENT_CONTAINER,
                                   ("sh", "-c", "echo out; echo err >&2; exit 7"))
    assert (end, out, err) == (kube.ExecEnd(7, end.message if end else ""), b"out\n", b"err\n")


def test_zz_delete_leaves_nothing(namespace, session):
    """Runs last (pytest keeps file order): the Pod and what came with it deleted, the namespace empty."""
    api, ns = namespace.api, namespace.name
    session.channel.close()
    api.delete(kube.Resource.PODS, ns, session.pod, grace_period_s=0)
    api.delete(kube.Resource.CONFIG_MAPS, ns, session.config_map)
    api.delete(kube.Resource.NETWORK_POLICIES, ns, kube.sessions_network_policy(SERVE_ID)["metadata"]["name"])

    def gone() -> bool:
        try:
            api.get(kube.Resource.PODS, ns, session.pod)
        except kube.KubeNotFound:
            return True
        return False

    wait_until("the session Pod gone", gone, 60)
    for resource in (kube.Resource.PODS, kube.Resource.CONFIG_MAPS, kube.Resource.NETWORK_POLICIES):
        left = [item["metadata"]["name"] for item in api.list(resource, ns)
                if item["metadata"]["name"] != "kube-root-ca.crt"]  # the ConfigMap every namespace gets
        assert left == [], resource
