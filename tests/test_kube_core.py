"""reploy_kube's pure cores, without a cluster: the kubeconfig parser, the WebSocket codec and handshake, the v4 exec
channels, Status objects, and the session Pod with every sandbox field."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reploy_kube as kube  # noqa: E402
from reploy import Runtime  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# kubeconfig and in-cluster configuration

CA_DATA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n").decode()


def kubeconfig(cluster: dict | None = None, user: dict | None = None, context: dict | None = None) -> dict:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "main",
        "contexts": [{"name": "main", "context": {"cluster": "c", "user": "u", **(context or {})}},
                     {"name": "other", "context": {"cluster": "c2", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": cluster if cluster is not None else
                      {"server": "https://127.0.0.1:16443", "certificate-authority-data": CA_DATA}},
                     {"name": "c2", "cluster": {"server": "https://10.0.0.1", "certificate-authority": "ca.pem"}}],
        "users": [{"name": "u", "user": user if user is not None else
                   {"client-certificate": "admin.crt", "client-key": "/abs/admin.key"}}],
    }


def test_kubeconfig_current_context_with_data_and_files(tmp_path):
    access = kube.parse_kubeconfig(kubeconfig(context={"namespace": "team"}), tmp_path)
    assert access.server == "https://127.0.0.1:16443"
    assert access.host_port == ("127.0.0.1", 16443)
    assert access.ca == base64.b64decode(CA_DATA)
    assert access.client_certificate == tmp_path / "admin.crt"  # relative to the kubeconfig's directory
    assert access.client_key == Path("/abs/admin.key")
    assert access.token is None and access.token_file is None
    assert access.namespace == "team"


def test_kubeconfig_named_context_default_port_and_ca_file(tmp_path):
    access = kube.parse_kubeconfig(kubeconfig(), tmp_path, context_name="other")
    assert access.host_port == ("10.0.0.1", 443) and access.ca == tmp_path / "ca.pem"
    assert access.namespace is None


@pytest.mark.parametrize("user, attribute, value", [
    ({"token": "abc.def"}, "token", "abc.def"),
    ({"tokenFile": "tok"}, "token_file", Path("/k/tok")),
    ({"client-certificate-data": CA_DATA, "client-key-data": CA_DATA}, "client_key", base64.b64decode(CA_DATA)),
])
def test_kubeconfig_user_forms(user, attribute, value):
    assert getattr(kube.parse_kubeconfig(kubeconfig(user=user), Path("/k")), attribute) == value


@pytest.mark.parametrize("cluster, user, reason", [
    ({"server": "https://h", "certificate-authority-data": CA_DATA, "insecure-skip-tls-verify": True}, None,
     "insecure-skip-tls-verify is refused"),
    ({"server": "https://h"}, None, "no certificate-authority"),
    ({"server": "http://h", "certificate-authority-data": CA_DATA}, None, "not an https:// URL"),
    ({"server": "https://h:x", "certificate-authority-data": CA_DATA}, None, "no valid port"),
    ({"server": "https://h", "certificate-authority-data": "not base64!"}, None, "not base64"),
    ({"server": "https://h", "certificate-authority-data": CA_DATA, "certificate-authority": "f"}, None, "both"),
    ({"server": "https://h", "certificate-authority-data": CA_DATA, "proxy-url": "http://p"}, None,
     "does not take: proxy-url"),
    (None, {"exec": {"command": "aws"}}, "an exec credential plugin"),
    (None, {"auth-provider": {"name": "gcp"}}, "an auth-provider plugin"),
    (None, {"username": "a", "password": "b"}, "basic authentication"),
    (None, {"token": "t", "as": "admin"}, "impersonation"),
    (None, {"token": "t", "tokenFile": "f"}, "both token and tokenFile"),
    (None, {"client-certificate": "c"}, "needs its key"),
    (None, {}, "no client certificate and no token"),
    (None, {"token": "a\nb"}, "not one line"),
])
def test_kubeconfig_refusals(cluster, user, reason):
    with pytest.raises(kube.KubeConfigError, match=reason):
        kube.parse_kubeconfig(kubeconfig(cluster=cluster, user=user), Path("/k"))


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: d.pop("current-context"), "no current-context"),
    (lambda d: d["contexts"].append(d["contexts"][0]), "no single context named 'main'"),
    (lambda d: d.update(users="x"), "users is not a list"),
])
def test_kubeconfig_structure_refusals(mutate, reason):
    doc = kubeconfig()
    mutate(doc)
    with pytest.raises(kube.KubeConfigError, match=reason):
        kube.parse_kubeconfig(doc, Path("/k"))


def test_load_kubeconfig_reads_yaml_from_its_directory(tmp_path):
    path = tmp_path / "config"
    path.write_text(json.dumps(kubeconfig()))  # JSON is YAML
    assert kube.load_kubeconfig(path).client_certificate == tmp_path.resolve() / "admin.crt"
    path.write_text("a: [")
    with pytest.raises(kube.KubeConfigError, match="not YAML"):
        kube.load_kubeconfig(path)


def test_in_cluster_access(tmp_path):
    (tmp_path / "namespace").write_text("sessions\n")
    env = {kube.SERVICE_HOST_ENV: "fd00::1", kube.SERVICE_PORT_ENV: "443"}
    access = kube.in_cluster_access(env, tmp_path)
    assert access.server == "https://[fd00::1]:443" and access.host_port == ("fd00::1", 443)
    assert access.ca == tmp_path / "ca.crt" and access.token_file == tmp_path / "token"
    assert access.namespace == "sessions" and access.token is None
    with pytest.raises(kube.KubeConfigError, match="not in a cluster"):
        kube.in_cluster_access({}, tmp_path)


def test_bearer_token_file_is_read_again_after_its_interval(tmp_path):
    token = tmp_path / "token"
    token.write_text("one\n")
    now = [0.0]
    bearer = kube.BearerToken(kube.ClusterAccess("https://h", b"", token_file=token), clock=lambda: now[0])
    assert bearer.headers() == {"Authorization": "Bearer one"}
    token.write_text("two")
    assert bearer.headers() == {"Authorization": "Bearer one"}
    now[0] = kube.TOKEN_REREAD_S
    assert bearer.headers() == {"Authorization": "Bearer two"}


# ---------------------------------------------------------------------------------------------------------------------
# API paths and Status objects


def test_resource_paths_and_selectors():
    assert kube.resource_path(kube.Resource.PODS, "ns", "p", "exec") == "/api/v1/namespaces/ns/pods/p/exec"
    assert kube.resource_path(kube.Resource.LEASES, "ns") == "/apis/coordination.k8s.io/v1/namespaces/ns/leases"
    assert kube.label_selector({"a": "1", "b.c/d": "x_y"}) == "a=1,b.c/d=x_y"
    for bad in ("UPPER", "-x", "a" * 64, "a/b", ""):
        with pytest.raises(ValueError):
            kube.resource_path(kube.Resource.PODS, "ns", bad)
    with pytest.raises(ValueError):
        kube.label_selector({"a": "x,b=y"})


@pytest.mark.parametrize("reason, cls", [("NotFound", kube.KubeNotFound), ("AlreadyExists", kube.KubeAlreadyExists),
                                         ("Conflict", kube.KubeConflict), ("Forbidden", kube.KubeApiError)])
def test_status_error_by_reason(reason, cls):
    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                       "reason": reason, "message": "pods \"x\"\x1b[31m is taken"}).encode()
    error = kube.status_error(409, body)
    assert type(error) is cls and error.code == 409 and error.reason == reason
    assert "\x1b" not in error.message and "is taken" in error.message


def test_status_error_without_a_status():
    error = kube.status_error(502, b"<html>bad gateway</html>")
    assert type(error) is kube.KubeApiError and error.code == 502 and error.reason == "Bad Gateway"
    assert error.message == "<html>bad gateway</html>"


@pytest.mark.parametrize("status, end", [
    ({"metadata": {}, "status": "Success"}, kube.ExecEnd(0, "")),
    ({"status": "Failure", "message": "command terminated with non-zero exit code",
      "reason": "NonZeroExitCode", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}},
     kube.ExecEnd(3, "command terminated with non-zero exit code")),
    ({"status": "Failure", "message": "executable file not found"}, kube.ExecEnd(None, "executable file not found")),
])
def test_exec_end(status, end):
    assert kube.exec_end(json.dumps(status).encode()) == end


@pytest.mark.parametrize("payload", [b"nope", b'{"status":"Maybe"}',
                                     b'{"status":"Failure","details":{"causes":[{"reason":"ExitCode","message":"x"}]}}',
                                     b'{"status":"Failure","details":{"causes":[{"reason":"ExitCode","message":"256"}]}}'])
def test_exec_end_refuses_what_is_not_a_status(payload):
    with pytest.raises(kube.WebSocketError):
        kube.exec_end(payload)


def test_exec_query_is_one_command_per_argument():
    query = kube.exec_query(["python3", "-c", "a b&c"], "agent", stdin=True)
    assert query == ("command=python3&command=-c&command=a+b%26c&container=agent&stdin=true&stdout=true"
                     "&stderr=true&tty=false")


# ---------------------------------------------------------------------------------------------------------------------
# The WebSocket codec

MASK = b"\x01\x02\x03\x04"


def test_accept_key_of_rfc_6455():
    assert kube.websocket_accept("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_masking_is_its_own_inverse_and_matches_the_rfc():
    # RFC 6455 5.7: "Hello" masked with 37 fa 21 3d
    assert kube.mask_payload(b"Hello", bytes.fromhex("37fa213d")) == bytes.fromhex("7f9f4d5158")
    data = os.urandom(1000)
    assert kube.mask_payload(kube.mask_payload(data, MASK), MASK) == data
    assert kube.mask_payload(b"", MASK) == b""


@pytest.mark.parametrize("length, header", [(0, 2), (125, 2), (126, 4), (65535, 4), (65536, 10)])
def test_lengths_round_trip_in_their_fewest_bytes(length, header):
    payload = os.urandom(length)
    unmasked = kube.encode_frame(kube.Opcode.BINARY, payload, None)
    assert len(unmasked) == header + length
    assert kube.FrameDecoder(max_message_bytes=1 << 20).feed(unmasked) == [kube.WebSocketMessage(kube.Opcode.BINARY, payload)]
    masked = kube.encode_frame(kube.Opcode.BINARY, payload, MASK)
    assert len(masked) == header + 4 + length and (masked[1] & 0x80)
    decoder = kube.FrameDecoder(max_message_bytes=1 << 20, masked=True)
    assert decoder.feed(masked) == [kube.WebSocketMessage(kube.Opcode.BINARY, payload)]


def test_frames_fed_one_byte_at_a_time():
    data = kube.encode_frame(kube.Opcode.BINARY, b"x" * 300, None) + kube.encode_frame(kube.Opcode.PING, b"p", None)
    decoder = kube.FrameDecoder()
    got = [m for i in range(len(data)) for m in decoder.feed(data[i:i + 1])]
    assert got == [kube.WebSocketMessage(kube.Opcode.BINARY, b"x" * 300), kube.WebSocketMessage(kube.Opcode.PING, b"p")]


def test_fragments_join_and_control_frames_pass_between_them():
    data = (kube.encode_frame(kube.Opcode.TEXT, "h\u00e9".encode()[:2], None, fin=False)
            + kube.encode_frame(kube.Opcode.PING, b"!", None)
            + kube.encode_frame(kube.Opcode.CONTINUATION, "h\u00e9".encode()[2:] + b"!", None, fin=False)
            + kube.encode_frame(kube.Opcode.CONTINUATION, b"", None))
    assert kube.FrameDecoder().feed(data) == [kube.WebSocketMessage(kube.Opcode.PING, b"!"),
                                              kube.WebSocketMessage(kube.Opcode.TEXT, "h\u00e9!".encode())]


def test_close_codes():
    assert kube.decode_close(b"") == kube.CloseReason(None)
    assert kube.decode_close(kube.encode_close(1000, "bye")) == kube.CloseReason(1000, "bye")
    assert kube.decode_close(kube.encode_close(4001)) == kube.CloseReason(4001, "")
    for code in (999, 1004, 1005, 1006, 1015, 2999, 5000):
        with pytest.raises(kube.WebSocketError, match="may not travel"):
            kube.decode_close(code.to_bytes(2, "big"))
        with pytest.raises(ValueError):
            kube.encode_close(code)
    with pytest.raises(kube.WebSocketError, match="one byte"):
        kube.decode_close(b"\x03")
    with pytest.raises(kube.WebSocketError, match="not UTF-8"):
        kube.decode_close(b"\x03\xe8\xff")
    frame = kube.encode_frame(kube.Opcode.CLOSE, kube.encode_close(1001), None)
    assert kube.FrameDecoder().feed(frame) == [kube.WebSocketMessage(kube.Opcode.CLOSE, b"\x03\xe9")]


def frame_bytes(first: int, second: int, rest: bytes = b"") -> bytes:
    return bytes([first, second]) + rest


@pytest.mark.parametrize("data, reason", [
    (kube.encode_frame(kube.Opcode.BINARY, b"x", MASK), "a server's frame is masked"),
    (frame_bytes(0xC2, 0), "reserved bit"),
    (frame_bytes(0x83, 0), "unknown opcode 3"),
    (frame_bytes(0x80, 0), "no message to continue"),
    (kube.encode_frame(kube.Opcode.BINARY, b"a", None, fin=False) * 2, "before the fragmented one ended"),
    (frame_bytes(0x09, 0), "control frame that is fragmented"),
    (frame_bytes(0x89, 126, (126).to_bytes(2, "big")), "control frame that is fragmented or longer"),
    (frame_bytes(0x82, 126, (125).to_bytes(2, "big")), "fewest bytes"),
    (frame_bytes(0x82, 127, (65535).to_bytes(8, "big")), "fewest bytes"),
    (frame_bytes(0x82, 127, (1 << 63).to_bytes(8, "big")), "top bit"),
    (kube.encode_frame(kube.Opcode.TEXT, b"\xff", None), "not UTF-8"),
    (kube.encode_frame(kube.Opcode.CLOSE, b"\x03\xed", None), "close code 1005 may not travel"),
])
def test_decoder_refusals(data, reason):
    decoder = kube.FrameDecoder()
    with pytest.raises(kube.WebSocketError, match=reason):
        decoder.feed(data)
    with pytest.raises(kube.WebSocketError, match="already broke"):
        decoder.feed(b"")


def test_a_message_over_the_bound_is_refused_from_its_declared_length():
    decoder = kube.FrameDecoder(max_message_bytes=1000)
    head = kube.encode_frame(kube.Opcode.BINARY, b"x" * 1001, None)[:4]
    with pytest.raises(kube.WebSocketError, match="longer than 1000"):
        decoder.feed(head)  # refused before a byte of its payload is held
    fragments = kube.FrameDecoder(max_message_bytes=1000)
    assert fragments.feed(kube.encode_frame(kube.Opcode.BINARY, b"x" * 600, None, fin=False)) == []
    with pytest.raises(kube.WebSocketError, match="longer than 1000"):
        fragments.feed(kube.encode_frame(kube.Opcode.CONTINUATION, b"x" * 401, None)[:4])
    exact = kube.FrameDecoder(max_message_bytes=1000)
    assert exact.feed(kube.encode_frame(kube.Opcode.BINARY, b"x" * 1000, None))[0].payload == b"x" * 1000


def test_encode_refuses_a_long_or_fragmented_control_frame():
    with pytest.raises(ValueError):
        kube.encode_frame(kube.Opcode.PING, b"x" * 126, MASK)
    with pytest.raises(ValueError):
        kube.encode_frame(kube.Opcode.CLOSE, b"", MASK, fin=False)
    with pytest.raises(ValueError):
        kube.encode_frame(kube.Opcode.BINARY, b"", b"abc")


# ---------------------------------------------------------------------------------------------------------------------
# The handshake and the v4 channels

KEY = "dGhlIHNhbXBsZSBub25jZQ=="
GOOD = ("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nSec-WebSocket-Protocol: v4.channel.k8s.io")


def test_handshake_request_asks_for_v4():
    request = kube.handshake_request("h:1", "/p?q", KEY, {"Authorization": "Bearer t"}).decode()
    assert request.startswith("GET /p?q HTTP/1.1\r\nHost: h:1\r\n") and request.endswith("\r\n\r\n")
    for line in ("Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {KEY}",
                 "Sec-WebSocket-Version: 13", "Sec-WebSocket-Protocol: v4.channel.k8s.io", "Authorization: Bearer t"):
        assert f"\r\n{line}\r\n" in request


def test_handshake_response_checks():
    kube.check_handshake_response(GOOD.encode(), KEY)
    with pytest.raises(kube.WebSocketError, match="does not answer our key"):
        kube.check_handshake_response(GOOD.encode(), "AAAAAAAAAAAAAAAAAAAAAA==")
    with pytest.raises(kube.WebSocketError, match="did not agree"):
        kube.check_handshake_response(GOOD.replace("v4.", "v3.").encode(), KEY)
    with pytest.raises(kube.WebSocketError, match="not an upgrade"):
        kube.check_handshake_response(GOOD.replace("Upgrade: websocket", "Upgrade: h2c").encode(), KEY)
    with pytest.raises(kube.WebSocketError, match="no HTTP status line"):
        kube.check_handshake_response(b"SSH-2.0", KEY)
    with pytest.raises(kube.KubeApiError) as refused:
        kube.check_handshake_response(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json", KEY)
    assert refused.value.code == 403 and refused.value.reason == "Forbidden"


def test_channels():
    assert kube.channel_message(kube.Channel.STDIN, b"x") == b"\x00x"
    assert kube.split_channel(kube.WebSocketMessage(kube.Opcode.BINARY, b"\x02err")) == (kube.Channel.STDERR, b"err")
    for message in (kube.WebSocketMessage(kube.Opcode.TEXT, b"\x01x"), kube.WebSocketMessage(kube.Opcode.BINARY, b""),
                    kube.WebSocketMessage(kube.Opcode.BINARY, b"\x05x")):
        with pytest.raises(kube.WebSocketError):
            kube.split_channel(message)


def test_line_splitter_bounds_a_line_across_pieces():
    splitter = kube.LineSplitter(5)
    assert splitter.feed(b"ab") == [] and splitter.feed(b"c\nde") == [b"abc"] and splitter.feed(b"f\n\n") == [b"def", b""]
    assert splitter.feed(b"12345") == [] and splitter.feed(b"\n") == [b"12345"]
    with pytest.raises(kube.WebSocketError, match="longer than 5"):
        splitter.feed(b"123456")
    with pytest.raises(kube.WebSocketError, match="longer than 5"):
        kube.LineSplitter(5).feed(b"123456\n")


# ---------------------------------------------------------------------------------------------------------------------
# The session Pod

RUNTIME = Runtime(uid=1000, gid=1001, writable_paths=("/tmp", "/var/cache/app"), memory_mib=256, pids=128)
FILES = {"agent.py": b"print('agent')\n", "__pycache__/agent.cpython-311.pyc": b"\x00\xffbytecode"}


def pod_spec(**changes) -> kube.SessionPodSpec:
    values: dict[str, Any] = dict(session_id="0123456789abcdef", serve_id="serve-a", image="reploy/managed:g1",
                  pull_policy=kube.PullPolicy.NEVER, command=("python3", "agent.py", "serve"),
                  environment=(("HOME", "/mnt/reploy-home"), ("LANG", "C.UTF-8")), runtime=RUNTIME, cpu_millis=500,
                  session_disk_mib=1024, agent_config_map=kube.agent_config_map_name(FILES),
                  session_mount="/mnt/reploy-session")
    values.update(changes)
    return kube.SessionPodSpec(**values)


def test_agent_config_map_holds_the_files_by_content():
    config_map = kube.agent_config_map(FILES, "serve-a")
    assert config_map["metadata"]["name"] == kube.agent_config_map_name(FILES)
    assert config_map["immutable"] is True
    assert config_map["data"] == {"agent.py": "print('agent')\n"}
    assert config_map["binaryData"] == {"__pycache__..agent.cpython-311.pyc": base64.b64encode(b"\x00\xffbytecode").decode()}
    assert kube.config_map_items(config_map) == [
        {"key": "__pycache__..agent.cpython-311.pyc", "path": "__pycache__/agent.cpython-311.pyc", "mode": 0o444},
        {"key": "agent.py", "path": "agent.py", "mode": 0o444}]
    assert kube.agent_config_map_name({**FILES, "agent.py": b"changed"}) != config_map["metadata"]["name"]
    for bad in ("/etc/passwd", "../x", "a b"):
        with pytest.raises(ValueError):
            kube.agent_config_map({bad: b""}, "serve-a")


def test_session_pod_writes_out_the_whole_sandbox():
    pod = kube.session_pod(pod_spec(), kube.agent_config_map(FILES, "serve-a"))
    assert pod["metadata"] == {"name": "reploy-session-0123456789abcdef", "labels": {
        "io.reploy.serve": "serve-a", "io.reploy.session.role": "managed",
        "io.reploy.session.live-run": "0123456789abcdef"}}
    spec = pod["spec"]
    assert {k: v for k, v in spec.items() if k not in ("initContainers", "containers", "volumes")} == {
        "restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
        "hostNetwork": False, "hostPID": False, "hostIPC": False, "shareProcessNamespace": True,
        "hostname": "session", "terminationGracePeriodSeconds": 5,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}
    (layout,), (agent,) = spec["initContainers"], spec["containers"]
    resources = {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "500m", "memory": "256Mi"}}
    base = {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"}}
    assert agent["securityContext"] == {**base, "capabilities": {"drop": ["ALL"],
                                                                 "add": ["SETUID", "SETGID", "SETPCAP", "KILL"]}}
    assert layout["securityContext"] == {**base, "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}}
    assert agent["resources"] == resources and layout["resources"] == resources
    assert agent["command"] == ["python3", "agent.py", "serve"]
    assert agent["env"] == [{"name": "HOME", "value": "/mnt/reploy-home"}, {"name": "LANG", "value": "C.UTF-8"}]
    assert agent["imagePullPolicy"] == layout["imagePullPolicy"] == "Never"
    assert agent["stdin"] is False and agent["tty"] is False
    mounts = [{"name": "agent-files", "mountPath": "/opt/reploy", "readOnly": True},
              {"name": "session", "mountPath": "/mnt/reploy-session"},
              {"name": "home", "mountPath": "/mnt/reploy-home"},
              {"name": "writable-0", "mountPath": "/tmp"}, {"name": "writable-1", "mountPath": "/var/cache/app"}]
    assert agent["volumeMounts"] == mounts and layout["volumeMounts"] == mounts[1:]
    assert layout["command"][:4] == ["python3", "-I", "-S", "-c"]
    assert layout["command"][5:] == ["1000", "1001", "/mnt/reploy-session", "/mnt/reploy-home", "/tmp",
                                     "/var/cache/app"]
    assert spec["volumes"] == [
        {"name": "agent-files", "configMap": {"name": kube.agent_config_map_name(FILES), "defaultMode": 0o444,
                                              "items": kube.config_map_items(kube.agent_config_map(FILES, "x"))}},
        {"name": "session", "emptyDir": {"sizeLimit": "1024Mi"}},
        {"name": "home", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "writable-0", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}},
        {"name": "writable-1", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}]


def test_layout_program_gives_the_agent_the_modes_it_demands(tmp_path):
    session, home, scratch = tmp_path / "session", tmp_path / "home", tmp_path / "scratch"
    for directory in (session, home, scratch):
        directory.mkdir()
        directory.chmod(0o777)  # as an emptyDir comes
    uid, gid = os.getuid(), os.getgid()  # chown to oneself needs no privilege
    subprocess.run([sys.executable, "-I", "-S", "-c", kube.LAYOUT_PROGRAM, str(uid), str(gid), str(session),
                    str(home), str(scratch)], check=True)
    modes = {path.relative_to(tmp_path).as_posix(): (path.stat().st_mode & 0o7777, path.stat().st_uid)
             for path in (session, session / "agent", session / "workspace", home, scratch)}
    assert modes == {"session": (0o755, uid), "session/agent": (0o700, uid), "session/workspace": (0o700, uid),
                     "home": (0o700, uid), "scratch": (0o755, uid)}


def test_session_pod_refuses_names_kubernetes_would_refuse():
    config_map = kube.agent_config_map(FILES, "serve-a")
    with pytest.raises(ValueError, match="label value"):
        kube.session_pod(pod_spec(serve_id="serve a"), config_map)
    with pytest.raises(ValueError, match="DNS label"):
        kube.session_pod(pod_spec(session_id="X" * 60), config_map)


def test_sessions_network_policy_denies_both_ways():
    policy = kube.sessions_network_policy("serve-a")
    assert policy["spec"] == {"podSelector": {"matchLabels": {"io.reploy.serve": "serve-a",
                                                              "io.reploy.session.role": "managed"}},
                              "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}
    assert policy["metadata"]["labels"] == {"io.reploy.serve": "serve-a"}


def test_relay_command_is_the_agent_command_with_the_relay_verb():
    assert kube.relay_command(("python3", "-c", "x"), "/mnt/s") == ("python3", "-c", "x", "relay", "--session-dir",
                                                                     "/mnt/s")


def test_pod_ready_and_why_a_pod_will_not_run():
    running = {"phase": "Running", "containerStatuses": [{"name": "agent", "ready": True, "state": {"running": {}}}]}
    assert kube.pod_ready(running) and kube.pod_failure(running) is None
    initializing = {"phase": "Pending", "initContainerStatuses": [{"name": "layout", "state": {"running": {}}}],
                    "containerStatuses": [{"name": "agent", "ready": False,
                                           "state": {"waiting": {"reason": "PodInitializing"}}}]}
    assert not kube.pod_ready(initializing) and kube.pod_failure(initializing) is None
    assert not kube.pod_ready({"phase": "Running", "containerStatuses": []})
    laid_out = {"phase": "Pending", "initContainerStatuses": [{"name": "layout", "state": {
        "terminated": {"exitCode": 0, "reason": "Completed"}}}]}
    assert kube.pod_failure(laid_out) is None
    never = {"phase": "Pending", "initContainerStatuses": [{"name": "layout", "state": {"waiting": {
        "reason": "ErrImageNeverPull", "message": "image \"x\" is not present\x1b[0m"}}}]}
    assert kube.pod_failure(never) == 'container layout: ErrImageNeverPull: image "x" is not present [0m'
    layout_failed = {"phase": "Pending", "initContainerStatuses": [{"name": "layout", "state": {
        "terminated": {"exitCode": 1, "reason": "Error", "message": "PermissionError"}}}]}
    assert kube.pod_failure(layout_failed) == "container layout exited 1: Error PermissionError"
    agent_exited = {"phase": "Running", "containerStatuses": [{"name": "agent", "state": {
        "terminated": {"exitCode": 0, "reason": "Completed"}}}]}
    assert kube.pod_failure(agent_exited) == "container agent exited 0: Completed"
    assert kube.pod_failure({"phase": "Failed", "reason": "Evicted", "message": "ephemeral storage"}) == \
        "the Pod ended (Failed): Evicted ephemeral storage"


def test_files_are_copied_only_into_the_agent_dir():
    assert kube.agent_file_path("/mnt/s", "checkpoint-a1.tar") == "/mnt/s/agent/checkpoint-a1.tar"
    for bad in ("../workspace/x", "a/b", ".hidden", "", "x" * 129):
        with pytest.raises(ValueError):
            kube.agent_file_path("/mnt/s", bad)
