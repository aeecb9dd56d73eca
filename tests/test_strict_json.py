"""The one strict JSON parser and every parser of a peer's bytes built on it (issue 26, item 8).

The standalone role files (agent.py, reploy_session_client.py, reploy_watchdog.py) each carry
the same "Strict JSON" section, so each still runs alone; the first test keeps the copies
identical. Then the parser's rules, then hypothesis throws hostile bytes (deep nesting
included) at every parser that reads a peer, and last the real agent, watchdog and broker
processes meet deep nesting on their real sockets and answer the next request.
"""

from __future__ import annotations

import ast
import json
import os
import select
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agent
import reploy
import reploy_client
import reploy_serve as serve
import reploy_session_client as wire
import reploy_watchdog as wd
from agent_fixtures.harness import raw_exchange, short_dir, start_agent  # noqa: F401
from conftest import ROOT, wait_watchdog_exit
from test_broker import BrokerHarness, read_event, run_client_command
from test_agent_listen import start_listening, tcp_call, tcp_exchange  # noqa: F401
from test_framing import FramePeer
from test_watchdog import HOST, RUN_A, RUN_B, environ, make_core, start_host, write_manifest

STANDALONE_ROLE_FILES = ("agent.py", "reploy_session_client.py", "reploy_watchdog.py")
#: The section's top-level definitions, in order: nothing else may sit between them.
SECTION_NAMES = ("MAX_JSON_DEPTH", "StrictJsonError", "_json_pairs", "_json_constant",
                 "_json_float", "_STRICT_JSON", "_json_depth", "parse_strict_json")
PARSERS = {"agent": agent.parse_strict_json, "wire": wire.parse_strict_json,
           "watchdog": wd.parse_strict_json}
DEPTH = agent.MAX_JSON_DEPTH
RUNTIME = reploy.Runtime(uid=1000, gid=1000, writable_paths=(), memory_mib=512, pids=256)
#: What killed the agent and the watchdog before: one line of openers.
AGENT_KILLER = b"[" * 200_000
WATCHDOG_KILLER = b"[" * 5_000


# ---------------------------------------------------------------------------------------------
# One section, word for word, in each standalone role file
# ---------------------------------------------------------------------------------------------


def _defined_name(node: ast.stmt) -> str:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return ""


def strict_json_section(path: Path) -> str:
    """The source from the first to the last of SECTION_NAMES (comments and blank lines
    between them included), after checking they are consecutive top-level statements."""
    source = path.read_text()
    body = ast.parse(source).body
    names = [_defined_name(node) for node in body]
    first = names.index(SECTION_NAMES[0])
    nodes = body[first:first + len(SECTION_NAMES)]
    assert tuple(_defined_name(node) for node in nodes) == SECTION_NAMES, path.name
    assert all(names.count(name) == 1 for name in SECTION_NAMES), path.name
    lines = source.splitlines(keepends=True)
    return "".join(lines[nodes[0].lineno - 1:nodes[-1].end_lineno])


def test_the_standalone_role_files_carry_the_same_strict_json_section() -> None:
    sections = {name: strict_json_section(ROOT / name) for name in STANDALONE_ROLE_FILES}
    assert len(set(sections.values())) == 1, "the Strict JSON sections differ: copy one to all"


@pytest.mark.parametrize("path", ["reploy.py", "reploy_serve.py", "reploy_client.py"])
def test_the_other_role_files_use_the_client_s_parser_with_a_bound(
        path: str) -> None:
    """They import reploy_session_client (they cannot run without it): its copy is theirs."""
    calls = [node for node in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "parse_strict_object"]
    assert calls and all(any(k.arg == "max_bytes" for k in call.keywords) for call in calls)


# ---------------------------------------------------------------------------------------------
# The parser's rules (the same in every copy)
# ---------------------------------------------------------------------------------------------

REFUSED = {
    "deep arrays": (AGENT_KILLER, "nested deeper than 32"),
    "deep objects": (b'{"a":' * 5_000, "nested deeper than 32"),
    "one level too deep": (b"[" * (DEPTH + 1) + b"]" * (DEPTH + 1), "nested deeper than 32"),
    "deep below a valid envelope": (b'{"params":' + b"[" * 2_000 + b"]" * 2_000 + b"}", "nested"),
    "duplicate field": (b'{"a":1,"a":2}', "duplicate field 'a'"),
    "NaN": (b'{"a":NaN}', "non-standard JSON constant NaN"),
    "Infinity": (b"[-Infinity]", "non-standard JSON constant -Infinity"),
    "beyond a float": (b"[1e999]", "beyond a float's range"),
    "integer past int()'s digits": (b"1" * 5_000, "malformed JSON"),
    "not UTF-8": (b'"\xff"', "invalid UTF-8 at byte 1"),
    "trailing data": (b"{} {}", "malformed JSON: Extra data"),
    "empty": (b"", "malformed JSON"),
    "too large": (b"[" + b" " * 100 + b"]", "more than 64 bytes"),
}


@pytest.mark.parametrize("copy", PARSERS)
@pytest.mark.parametrize("case", REFUSED)
def test_each_copy_refuses_what_it_must_with_its_own_error(copy: str, case: str) -> None:
    data, fragment = REFUSED[case]
    parse = PARSERS[copy]
    with pytest.raises(parse.__globals__["StrictJsonError"]) as caught:
        parse(data, 64 if case == "too large" else len(data) + 1)
    assert fragment in str(caught.value)


@pytest.mark.parametrize("copy", PARSERS)
@pytest.mark.parametrize("text", [
    '{"id":"r1","method":"status","params":{}}', ' [1, 2.5, -0, "\\u00e9", true, null] \n',
    '"a lone value"', "[" * DEPTH + "]" * DEPTH, '{"a":' * (DEPTH - 1) + "{}" + "}" * (DEPTH - 1),
    '{"big": 1e308, "small": -1e-320}',
], ids=["request", "spaced-array", "string", "deepest-arrays", "deepest-objects", "floats"])
def test_each_copy_reads_valid_input_as_json_loads_does(copy: str, text: str) -> None:
    assert PARSERS[copy](text.encode(), len(text.encode())) == json.loads(text)


@pytest.mark.parametrize("data, fragment", [
    (b" {}", "whitespace around"), (b"{}\n", "whitespace around"), (b"[]", "a JSON object"),
    (b'{"a":"\\ud800"}', "lone surrogate"), (WATCHDOG_KILLER, "nested deeper than 32"),
], ids=["leading-space", "trailing-newline", "array", "lone-surrogate", "deep"])
def test_the_client_s_object_parser_keeps_its_own_rules_on_top(data: bytes, fragment: str) -> None:
    with pytest.raises(wire.ProtocolError, match=fragment) as caught:
        wire.parse_strict_object(data, max_bytes=wire.MAX_LINE_BYTES)
    assert caught.value.code == "invalid_request"


# ---------------------------------------------------------------------------------------------
# Every parser of a peer's bytes, fuzzed: hostile bytes end in that parser's own error
# ---------------------------------------------------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers()
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=8), children, max_size=4),
                           max_leaves=24)
NESTERS = [(b"[", b"]"), (b'{"a":', b"}"), (b'[{"id":', b"}]"), (b'{"": [', b"]}")]


@st.composite
def deep_nesting(draw: st.DrawFn) -> bytes:
    """Openers (arrays, objects, mixed) from just under the bound to far past the interpreter's
    recursion limit, closed or not, under an envelope a parser might expect."""
    opener, closer = draw(st.sampled_from(NESTERS))
    depth = draw(st.integers(DEPTH // len(opener) - 2, 50_000) | st.sampled_from([1_000, 200_000]))
    inner = opener * depth + (b"0" + closer * depth if draw(st.booleans()) else b"")
    envelope = draw(st.sampled_from([b"%s", b'{"id":"x","method":"status","params":%s}',
                                     b'{"done":%s}', b'{"type":"arm","run_id":%s}',
                                     b'{"schema":"reploy-controlled-session-client-v1","type":%s}',
                                     b'{"id":"serve","result":%s}']))
    return envelope.replace(b"%s", inner)


HOSTILE = (st.binary(max_size=300) | JSON_VALUES.map(lambda v: json.dumps(v).encode())
           | deep_nesting()
           | st.dictionaries(st.sampled_from(["id", "method", "params", "type", "run_id", "done",
                                              "error", "result", "schema", "format"]),
                             JSON_VALUES, max_size=4).map(lambda v: json.dumps(v).encode()))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


def _projected(data: bytes) -> str:
    projector = agent.StreamJsonProjector()
    return projector.feed(data + b"\n") + projector.finish()


def _watchdog_core(data: bytes) -> list[Any]:
    core = make_core()
    core.connected(1, HOST)
    return core.received(1, data[:wd.MAX_MESSAGE_BYTES - 1] + b"\n")


#: Every parser of a peer's bytes, and the only errors it may raise (none: it answers anything).
PEER_PARSERS: dict[str, tuple[Callable[[bytes], Any], tuple[type[BaseException], ...]]] = {
    "agent-request": (agent.parse_request, (agent.RequestError,)),
    "agent-manifest": (agent.parse_manifest, (agent.ArchiveError,)),
    "agent-worker-packet": (agent.parse_worker_packet, (agent.WorkerProtocolError,)),
    "agent-child-report": (lambda data: agent.child_setup_error(data[:agent.CHILD_REPORT_BYTES]), ()),
    "agent-stream-json": (_projected, ()),
    "watchdog-codec": (lambda data: wd.decode(data, wd.HOST_MESSAGES), (wd.ProtocolError,)),
    "watchdog-core": (_watchdog_core, ()),
    "broker-request": (lambda data: wire.decode_message(data + b"\n", wire.Direction.REQUEST),
                       (wire.ProtocolError,)),
    "broker-event": (lambda data: wire.decode_message(data + b"\n", wire.Direction.EVENT),
                     (wire.ProtocolError,)),
    "channel-frame": (lambda data: wire.Frame(wire.FrameKind.EVENT, data).json(), (wire.ProtocolError,)),
    "serve-agent-status": (lambda data: serve.parse_agent_response("status", {}, data),
                           (serve.AnswerInvalid, serve.AgentCallError)),
    "serve-agent-list": (lambda data: serve.parse_agent_response("list", {}, data),
                         (serve.AnswerInvalid, serve.AgentCallError)),
    "serve-body": (lambda data: serve.parse_body(data, serve.BODY_RULES["create"]), (serve.ServeError,)),
    "session-client-answer": (lambda data: reploy_client.Client("http://127.0.0.1:1", "t" * 43).document(
        reploy_client.Answer(200, "application/json", data)), (reploy_client.ReployError,)),
    "host-probe-report": (lambda data: reploy.probe_problem(data, RUNTIME), ()),
}


@pytest.mark.parametrize("copy", PARSERS)
@FUZZ
@given(value=JSON_VALUES)
def test_each_copy_reads_any_valid_document_as_json_loads_does(copy: str, value: Any) -> None:
    """Behaviour on valid input is json.loads's (as the parsers before this one read it)."""
    data = json.dumps(value).encode()
    assert PARSERS[copy](data, len(data)) == json.loads(data)


@pytest.mark.parametrize("name", PEER_PARSERS)
@FUZZ
@given(data=HOSTILE)
def test_every_parser_of_a_peer_s_bytes_ends_hostile_input_in_its_own_error(name: str, data: bytes) -> None:
    parse, errors = PEER_PARSERS[name]
    try:
        parse(data)
    except errors:
        pass


# ---------------------------------------------------------------------------------------------
# The real processes, on their real sockets: hostile input, then the next request is answered
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line", [AGENT_KILLER, b'{"id":"d","method":"status","params":'
                                  + b"[" * 5_000 + b"}"], ids=["200KB-of-openers", "deep-params"])
def test_the_agent_answers_deep_nesting_and_then_the_next_request(start_agent, line: bytes) -> None:
    shell = start_agent("--workload", "shell")
    reply = json.loads(raw_exchange(shell.session_dir, line + b"\n"))
    assert reply["error"]["code"] == "invalid_request"
    assert "nested deeper than 32" in reply["error"]["message"]
    assert shell.proc.poll() is None
    assert shell.status()["turn_state"] == "idle"


def test_the_agent_s_tcp_listener_answers_deep_nesting_and_then_the_next_request(start_listening) -> None:
    """`agent.py serve --listen`: any peer of the port could kill the agent with one line."""
    shell, port = start_listening("--workload", "shell")
    reply = json.loads(tcp_exchange(port, AGENT_KILLER + b"\n"))
    assert reply["error"]["code"] == "invalid_request" and "nested deeper" in reply["error"]["message"]
    assert tcp_call(port, "status")["result"]["type"] == "status"
    assert shell.proc.poll() is None


def test_the_watchdog_answers_deep_nesting_and_keeps_serving(watchdog_dir: Path,
                                                             tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    host, watchdog = start_host(tmp_path, RUN_A, env)
    try:
        dir_fd = wd.open_runtime_dir(watchdog_dir)
        try:
            for hostile in (WATCHDOG_KILLER, b'{"type":"arm","run_id":' + b"[" * 4_000):
                peer = wd.connect(dir_fd)
                assert peer is not None
                with peer:
                    peer.settimeout(60)
                    peer.sendall(hostile + b"\n")
                    reply = wd.decode(peer.recv(wd.MAX_MESSAGE_BYTES).rstrip(b"\n"),
                                      wd.WATCHDOG_MESSAGES)
                    assert isinstance(reply, wd.Refused) and "nested deeper" in reply.message
                    assert peer.recv(1) == b""  # and hung up on
        finally:
            os.close(dir_fd)
        link = wd.arm(RUN_B, write_manifest(tmp_path, RUN_B), env)  # the next request
        assert link.watchdog == watchdog  # the same watchdog: it never died
        link.disarm()
    finally:
        host.kill()
        host.wait()
    assert wait_watchdog_exit(watchdog_dir)


def test_the_broker_process_refuses_a_deep_request_with_its_code_not_a_crash() -> None:
    """The broker's contract makes a bad controller request fatal: it must say invalid_request
    on its stream and exit 1 with its directory gone, never die of RecursionError."""
    home = tempfile.mkdtemp(prefix="rb-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(home, "channel.sock"))
    listener.listen(1)
    process = run_client_command({"PATH": os.environ.get("PATH", ""), "HOME": home,
                                  wire.SESSION_SOCKET_ENV: os.path.join(home, "channel.sock")})
    try:
        assert select.select([listener], [], [], 60)[0], "the client did not connect"
        host = FramePeer(listener.accept()[0])
        assert isinstance(read_event(process), wire.BrokerReady)
        process.stdin.write(AGENT_KILLER[:wire.MAX_LINE_BYTES - 1] + b"\n")
        process.stdin.flush()
        error = read_event(process)
        assert isinstance(error, wire.ClientError) and error.code == "invalid_request"
        assert process.wait(60) == 1
        assert b"RecursionError" not in process.stderr.read()
        assert os.listdir(home) == ["channel.sock"]
        host.close()
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)
        listener.close()
        shutil.rmtree(home)


@pytest.mark.parametrize("nesting", [WATCHDOG_KILLER, b'{"a":' * 3_000], ids=["arrays", "objects"])
def test_the_broker_refuses_a_deep_host_frame_with_its_code(nesting: bytes) -> None:
    harness = BrokerHarness()
    try:
        harness.up_to_ready()
        harness.host.send(wire.FrameKind.EVENT, nesting)
        harness.expect_fatal("invalid_request")  # what any malformed JSON in a frame is
    finally:
        harness.close()


def test_serve_s_client_refuses_a_deep_answer() -> None:
    client = reploy_client.Client("http://127.0.0.1:1", "t" * 43)
    with pytest.raises(reploy_client.ReployError, match="nested deeper than 32"):
        client.document(reploy_client.Answer(200, "application/json", WATCHDOG_KILLER))


def test_a_controller_image_probe_of_deep_nesting_fails_closed() -> None:
    problem = reploy.probe_problem(WATCHDOG_KILLER + b"\n", RUNTIME)
    assert problem is not None and "unreadable" in problem
