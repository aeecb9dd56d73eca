"""The pure cores of the harness verbs (exec and files), without processes or Docker: the request
parser's new fields, path confinement rules, upload archive vetting, how a command ended, and
serve's side (exec bodies and results, file routes, the error mapping, `session exec`/`cp`)."""

from __future__ import annotations

import base64
import io
import json
import signal
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent_fixtures.harness import agent

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reploy  # noqa: E402
import reploy_serve  # noqa: E402


def request(method: str, **params: object) -> agent.Request:
    return agent.parse_request(json.dumps({"id": "t", "method": method, "params": params}).encode())


def refused(method: str, **params: object) -> str:
    with pytest.raises(agent.RequestError) as info:
        request(method, **params)
    return str(info.value)


# -- the request parser -----------------------------------------------------------------------


def test_exec_params_take_defaults_and_convert() -> None:
    parsed = request("exec", argv=["sh", "-c", "true"], cwd="a/./b//", env={"X": "1"},
                     stdin_b64=base64.b64encode(b"in").decode()).params
    workspace, container = agent.FileRoot.WORKSPACE, agent.FileRoot.CONTAINER
    assert parsed == agent.ExecParams(argv=("sh", "-c", "true"), cwd=agent.Where(workspace, ("a", "b")),
                                      env=(("X", "1"),), stdin=b"in", stdin_path=None, timeout_ms=None,
                                      output_cap_bytes=1024 * 1024, detach=False)
    assert request("exec", argv=["true"]).params.stdin is None  # absent: /dev/null
    # An absolute cwd or stdin file starts at the container's `/`; the same rules hold below it.
    absolute = request("exec", argv=["true"], cwd="/usr//bin/", stdin_path="/tmp/in", detach=True).params
    assert (absolute.cwd, absolute.stdin_path, absolute.detach) == (
        agent.Where(container, ("usr", "bin")), agent.Where(container, ("tmp", "in")), True)


@pytest.mark.parametrize(("params", "words"), [
    ({"argv": []}, "non-empty array"),
    ({"argv": "true"}, "non-empty array"),
    ({"argv": [""]}, "program must be named"),
    ({"argv": ["a\0b"]}, "NUL"),
    ({"argv": ["x" * (2 * 1024 * 1024)]}, "exceeds"),
    ({"argv": ["true"], "env": {"HOME": "/"}}, "HOME is the session's"),
    ({"argv": ["true"], "env": {"1X": "v"}}, "not a variable name"),
    ({"argv": ["true"], "env": {"X": 1}}, "must be a string"),
    ({"argv": ["true"], "env": ["X"]}, "must be an object"),
    ({"argv": ["true"], "cwd": "/etc/../.."}, "'..'"),
    ({"argv": ["true"], "cwd": "a/../../etc"}, "'..'"),
    ({"argv": ["true"], "timeout_ms": 0}, "between 1 and"),
    ({"argv": ["true"], "output_cap_bytes": agent.MAX_EXEC_OUTPUT_CAP_BYTES + 1}, "between 0 and"),
    ({"argv": ["true"], "stdin_b64": base64.b64encode(b"x" * (agent.MAX_EXEC_STDIN_BYTES + 1)).decode()}, "limit is"),
    ({"argv": ["true"], "nope": 1}, "unknown params"),
])
def test_exec_params_refuse_what_does_not_fit(params: dict[str, object], words: str) -> None:
    assert words in refused("exec", **params)


def test_handles_roots_kinds_and_digests_are_checked() -> None:
    assert request("exec_kill", exec_id="0123456789abcdef").params == agent.HandleParams("0123456789abcdef")
    assert "must match" in refused("exec_kill", exec_id="../../x")
    assert "one of workspace, home" in refused("stat", root="etc")
    assert "one of file, tar" in refused("upload", path="x", kind="zip")
    assert "must match" in refused("upload_commit", transfer_id="0" * 16, sha256="ABC")
    assert "true or false" in refused("exec_wait", exec_id="0" * 16, release=1)
    upload = request("upload", path="d/f.txt").params
    assert upload == agent.UploadParams(agent.FileRoot.WORKSPACE, ("d", "f.txt"), agent.UploadKind.FILE,
                                        None, None)


def test_a_full_write_part_fits_the_request_line() -> None:
    """The largest part serve writes, as base64 in a write line with the longest id, is under 1 MiB."""
    data = b"\xff" * agent.MAX_WRITE_PART_BYTES
    line = json.dumps({"id": "x" * 256, "method": "write", "params": {
        "data_b64": base64.b64encode(data).decode()}}).encode()
    assert len(line) <= agent.MAX_REQUEST_BYTES
    assert agent.parse_request(line).params.data == data


def test_an_exec_wait_answer_fits_one_line() -> None:
    """Two full output pages as base64, with every other field, stay under the 1 MiB line."""
    page = base64.b64encode(b"\xff" * agent.EXEC_PAGE_BYTES).decode()
    answer = agent.encode_result("x" * 256, agent.Method.EXEC_WAIT, {
        "exec_id": "f" * 16, "running": False, "pid": 2**22, "exit_code": 255, "signal": None,
        "timed_out": False, "killed": False, "duration_ms": 86_400_000.0,
        **{f"{name}_{key}": value for name in ("stdout", "stderr")
           for key, value in (("b64", page), ("next_offset", 2**22), ("bytes", 2**22), ("truncated", True))}})
    assert len(answer) <= agent.MAX_REQUEST_BYTES


# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "parts"), [
    ("", ()), (".", ()), ("./", ()), ("a", ("a",)), ("a/b/", ("a", "b")), ("a//./b", ("a", "b")),
    ("..a/b..", ("..a", "b..")), ("é/ß", ("é", "ß")),
])
def test_relative_paths_become_components(text: str, parts: tuple[str, ...]) -> None:
    assert agent.parse_relative_path(text) == parts


@pytest.mark.parametrize(("text", "words"), [
    ("/etc/passwd", "absolute"), ("/", "absolute"), ("..", "'..'"), ("a/../b", "'..'"), ("a/..", "'..'"),
    ("a\0b", "NUL"), ("x" * 4097, "at most 4096"), ("a/" + "n" * 256, "longer than 255"), ("\udc80", "UTF-8"),
])
def test_paths_that_could_leave_the_root_are_refused(text: str, words: str) -> None:
    with pytest.raises(agent.RequestError, match="refused|bytes|UTF-8") as info:
        agent.parse_relative_path(text)
    assert words in str(info.value)


@pytest.mark.parametrize(("mode", "directory", "sane"), [
    (0o644, False, 0o644), (0o4755, False, 0o755), (0o777, False, 0o755), (0o000, False, 0o600),
    (0o2775, True, 0o755), (0o1777, True, 0o755), (0o000, True, 0o700), (0o711, True, 0o711),
])
def test_modes_are_made_sane(mode: int, directory: bool, sane: int) -> None:
    assert agent.sane_mode(mode, directory) == sane


def test_how_a_command_ended() -> None:
    assert agent.describe_exit(0) == (0, None)
    assert agent.describe_exit(3) == (3, None)
    assert agent.describe_exit(-signal.SIGKILL) == (None, "SIGKILL")
    assert agent.describe_exit(-200) == (None, "SIG200")


# -- upload archives ----------------------------------------------------------------------------


def member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, link
    return info


def test_a_plain_tree_is_accepted_with_names_normalised() -> None:
    members = [member(".", tarfile.DIRTYPE), member("./a", tarfile.DIRTYPE), member("./a/f", size=3), member("b/", tarfile.DIRTYPE),
               member("a/l", tarfile.SYMTYPE, link="f"), member("a/up", tarfile.SYMTYPE, link="../b"),
               member("a/h", tarfile.LNKTYPE, link="./a/f"), member("c/d/e", size=1)]
    assert [name for name, _ in agent.vet_upload_members(members)] == ["a", "a/f", "b", "a/l", "a/up", "a/h", "c/d/e"]


@pytest.mark.parametrize(("members", "words"), [
    ([member("../x", size=1)], "unsafe member name"),
    ([member("a/../../x", size=1)], "unsafe member name"),
    ([member("/etc/passwd", size=1)], "unsafe member name"),
    ([member("a//b")], "unsafe member name"),
    ([member("f"), member("./f")], "duplicate"),
    ([member("dev", tarfile.CHRTYPE)], "device node, FIFO"),
    ([member("blk", tarfile.BLKTYPE)], "device node, FIFO"),
    ([member("fifo", tarfile.FIFOTYPE)], "device node, FIFO"),
    ([member("l", tarfile.SYMTYPE, link="/etc")], "leaves the archive's tree"),
    ([member("l", tarfile.SYMTYPE, link="../etc")], "leaves the archive's tree"),
    ([member("a", tarfile.DIRTYPE), member("a/l", tarfile.SYMTYPE, link="../../x")], "leaves"),
    ([member("l", tarfile.SYMTYPE, link="d"), member("m", tarfile.SYMTYPE, link="l/..")], "leaves"),
    ([member("l", tarfile.SYMTYPE, link="."), member("l/x", size=1)], "below a symlink"),
    ([member("f", size=1), member("f/x", size=1)], "below a file"),
    ([member("h", tarfile.LNKTYPE, link="/etc/passwd")], "hard link"),
    ([member("h", tarfile.LNKTYPE, link="../x")], "hard link"),
    ([member("h", tarfile.LNKTYPE, link="f"), member("f", size=1)], "hard link"),  # not earlier
    ([member("d", tarfile.DIRTYPE), member("h", tarfile.LNKTYPE, link="d")], "hard link"),
    ([member("f", tarfile.SYMTYPE, link="x")], None),
    ([member(".", tarfile.REGTYPE)], "names the root"),
])
def test_hostile_archives_are_refused(members: list[tarfile.TarInfo], words: str | None) -> None:
    if words is None:  # a dangling symlink inside the tree is harmless
        agent.vet_upload_members(members)
        return
    with pytest.raises(agent.ArchiveError, match="refused") as info:
        agent.vet_upload_members(members)
    assert words in str(info.value)


def test_archive_limits() -> None:
    with pytest.raises(agent.ArchiveError, match="more than 2 entries"):
        agent.vet_upload_members([member("a"), member("b"), member("c")], max_entries=2)
    with pytest.raises(agent.ArchiveError, match="too large"):
        agent.vet_upload_members([member("a", size=6), member("b", size=5)], max_bytes=10)


# -- serve: exec bodies and results --------------------------------------------------------------


def test_exec_bodies_become_agent_params() -> None:
    fields = reploy_serve.parse_body(b'{"argv": ["sh", "-c", "exit 3"], "env": {"A": "b"}, "timeoutMs": 5, '
                               b'"stdinBase64": "aGk="}', reploy_serve.BODY_RULES["exec"])
    assert reploy_serve.exec_params(fields) == {
        "argv": ["sh", "-c", "exit 3"], "cwd": "", "env": {"A": "b"}, "timeout_ms": 5,
        "output_cap_bytes": 1024 * 1024, "stdin_b64": "aGk=", "detach": False}
    # No timeout given: none; a stdin file and detach pass on; a user is refused, root or not.
    assert reploy_serve.exec_params({"argv": ["a"], "stdinPath": "/tmp/in", "detach": True}) == {
        "argv": ["a"], "cwd": "", "env": {}, "output_cap_bytes": 1024 * 1024, "detach": True,
        "stdin_path": "/tmp/in"}
    for user in ("root", "1000"):
        with pytest.raises(reploy_serve.Unprocessable) as refused:
            reploy_serve.exec_params({"argv": ["id"], "user": user})
        assert refused.value.code == "user_unsupported" and refused.value.status == 422
    with pytest.raises(reploy_serve.BadRequest, match="detach: must be true or false"):
        reploy_serve.parse_body(b'{"argv": ["a"], "detach": 1}', reploy_serve.BODY_RULES["exec"])
    with pytest.raises(reploy_serve.BadRequest, match="argv: must be an array"):
        reploy_serve.parse_body(b'{"argv": "true"}', reploy_serve.BODY_RULES["exec"])
    with pytest.raises(reploy_serve.BadRequest, match="non-empty array of strings"):
        reploy_serve.exec_params({"argv": ["a", 1]})
    with pytest.raises(reploy_serve.BadRequest, match="every value must be a string"):
        reploy_serve.exec_params({"argv": ["a"], "env": {"A": 1}})
    with pytest.raises(reploy_serve.BadRequest):  # every input error is 400, as on seed 002's routes
        reploy_serve.parse_body(b'{"argv": ["a"], "timeoutMs": 0}', reploy_serve.BODY_RULES["exec"])
    big = base64.b64encode(b"x" * (reploy_serve.MAX_EXEC_STDIN_BYTES + 1)).decode()
    with pytest.raises(reploy_serve.PayloadTooLarge):
        reploy_serve.exec_params({"argv": ["a"], "stdinBase64": big})


EXEC_FINAL = {"exec_id": "e", "exit_code": None, "signal": "SIGKILL", "timed_out": True, "killed": False,
              "duration_ms": 12.5, "stdout_truncated": True, "stderr_truncated": False}


def exec_answer_of(streams: dict[str, bytes], page_bytes: int = 5,
                   sent: dict[str, bytes] | None = None) -> bytes:
    """The exec answer serve makes of `streams`, measured and then sent in pages of page_bytes
    (the bytes of `sent` in their place: what an agent changed in between)."""
    costs = {name: reploy_serve.TextCost() for name in reploy_serve.EXEC_STREAMS}
    for name, data in streams.items():
        for start in range(0, len(data), page_bytes):
            costs[name].feed(data[start:start + page_bytes])
    ended = reploy_serve.ExecEnded("e", EXEC_FINAL, {n: c.size_bytes for n, c in costs.items()},
                                   {n: c.encoding() for n, c in costs.items()})
    pages = sent or streams
    return b"".join(reploy_serve.exec_result_json(ended, lambda name: (
        pages[name][start:start + page_bytes] for start in range(0, len(pages[name]), page_bytes))))


def test_exec_results_carry_each_stream_once_in_its_cheaper_form() -> None:
    answer = json.loads(exec_answer_of({"stdout": b"out\xff", "stderr": "caf\u00e9 \"q\"\n".encode()}))
    assert answer == {"execId": "e", "exitCode": None, "signal": "SIGKILL", "timedOut": True,
                      "killed": False, "durationMs": 12.5,
                      "stdoutEncoding": "base64", "stdoutBase64": base64.b64encode(b"out\xff").decode(),
                      "stdoutTruncated": True,
                      "stderrEncoding": "text", "stderr": "caf\u00e9 \"q\"\n", "stderrTruncated": False}
    # A code point split between pages is still text; a few escapes still cheaper than base64.
    colour = b"\x1b[31m\xe2\x82\xac red\x1b[0m and plain words after it, enough of them\n"
    assert json.loads(exec_answer_of({"stdout": colour, "stderr": b""}, page_bytes=9))["stdout"] == (
        colour.decode())
    # Control bytes (six bytes each as JSON text) go as base64: an answer is never more than
    # its streams' base64 and the rest, whatever the bytes.
    for data in (b"\x01" * 3000, b"\xff" * 3000, b"\x00" * 3000, b'"' * 3000, bytes(range(256)) * 12):
        answer_bytes = exec_answer_of({"stdout": data, "stderr": data})
        assert len(answer_bytes) <= 2 * reploy_serve.base64_length(len(data)) + 400
        document = json.loads(answer_bytes)
        for name in reploy_serve.EXEC_STREAMS:
            kept = (document[name].encode() if document[f"{name}Encoding"] == "text"
                    else base64.b64decode(document[f"{name}Base64"]))
            assert kept == data and (name in document) != (f"{name}Base64" in document)


def test_an_exec_stream_that_changes_after_its_form_was_chosen_ends_the_answer() -> None:
    """An agent that sends other bytes the second time cannot make the answer longer than
    its streams' base64: the answer stops there (serve then ends its body short)."""
    with pytest.raises(reploy_serve.BadGateway, match="stdout changed"):
        exec_answer_of({"stdout": b"plain text " * 50, "stderr": b""},
                       sent={"stdout": b"\x01" * 550, "stderr": b""})


def test_exec_answers_are_bounded_per_session_and_in_all() -> None:
    """A slot past either bound is waited for; a wait that cannot last (its deadline passed)
    says so at once, and a slot given back is there for the next."""
    import threading

    slots = reploy_serve.AnswerSlots(per_session=1, total=2)

    def expired() -> reploy_serve.AgentWait:
        return reploy_serve.AgentWait("an answer slot", 0.0, lambda: False, threading.Event(), lambda: 1.0)

    with slots.hold("a", expired()):
        with pytest.raises(reploy_serve.GatewayTimeout):
            with slots.hold("a", expired()):
                pass
        with slots.hold("b", expired()):
            with pytest.raises(reploy_serve.GatewayTimeout):
                with slots.hold("c", expired()):
                    pass
    with slots.hold("a", expired()), slots.hold("c", expired()):
        pass


@pytest.mark.parametrize(("result", "code"), [
    ({"timed_out": False, "exit_code": 0, "signal": None}, 0),
    ({"timed_out": False, "exit_code": 3, "signal": None}, 3),
    ({"timed_out": False, "exit_code": None, "signal": "SIGTERM"}, 143),
    ({"timed_out": True, "exit_code": None, "signal": "SIGKILL"}, 124),
])
def test_raw_exec_exit_codes_follow_the_shell(result: dict[str, Any], code: int) -> None:
    executed = reploy_serve.client_role.ExecResult(stdout=b"", stderr=b"", truncated=False, **result)
    assert reploy_serve.raw_exec_exit_code(executed) == code


# -- serve: file routes, queries and the error mapping -------------------------------------------


def test_file_routes_carry_a_path_with_slashes() -> None:
    sid = "0123456789abcdef"
    assert reploy_serve.match_route("GET", f"/sessions/{sid}/files/a/b%20c.txt") == ("get_file", sid)
    assert reploy_serve.match_route("PUT", f"/sessions/{sid}/files/a") == ("put_file", sid)
    assert reploy_serve.match_route("GET", f"/sessions/{sid}/list") == ("list_files", sid)
    assert reploy_serve.match_route("POST", f"/sessions/{sid}/exec") == ("exec", sid)
    with pytest.raises(reploy_serve.MethodNotAllowed):
        reploy_serve.match_route("DELETE", f"/sessions/{sid}/files/a")
    assert reploy_serve.file_route_path(f"/sessions/{sid}/files/a/b%20c.txt?root=home") == "a/b c.txt"
    assert reploy_serve.file_route_path(f"/sessions/{sid}/list") == ""
    assert reploy_serve.file_route_path(f"/sessions/{sid}/files/..%2Fetc") == "../etc"  # refused by the agent
    assert set(reploy_serve.RAW_BODY_ROUTES) == {"put_file"}


def test_file_queries() -> None:
    FileQuery = reploy_serve.FileQuery
    assert reploy_serve.file_query("", "a") == FileQuery("workspace", "a")
    assert reploy_serve.file_query("root=home&mode=0755", "a") == FileQuery("home", "a", 0o755)
    # An absolute path starts at the container's `/`, whether or not ?root=container says so.
    assert reploy_serve.file_query("", "/etc/x") == FileQuery("container", "etc/x")
    assert reploy_serve.file_query("root=container", "tmp/x") == FileQuery("container", "tmp/x")
    digest = "0123456789abcdef" * 4
    assert reploy_serve.file_query(f"sha256={digest}", "a") == FileQuery("workspace", "a", sha256=digest)
    for query, path in (("root=etc", "a"), ("mode=0999", "a"), ("follow=1", "a"), ("root=home", "/etc"),
                        (f"sha256={digest.upper()}", "a"), (f"sha256={digest}0", "a"), ("sha256=", "a")):
        with pytest.raises(reploy_serve.BadRequest):
            reploy_serve.file_query(query, path)
    # What only an upload takes is refused on the routes that read.
    for query in ("mode=0644", f"sha256={digest}"):
        with pytest.raises(reploy_serve.BadRequest, match="only for uploads"):
            reploy_serve.file_query(query, "a").for_reading()
    assert reploy_serve.file_query("root=home", "a").for_reading() == FileQuery("home", "a")


@pytest.mark.parametrize(("code", "message", "status"), [
    ("command_error", "no such file or directory: a/b", 404),
    ("command_error", "not enough space in home: 3 MiB free", 507),
    ("invalid_request", "too large: 9 bytes", 413),
    ("invalid_request", "refused: a is a symlink", 422),
    ("command_error", "refused: unsafe member name '../x'", 422),
    ("command_error", "cannot run 'nope': No such file or directory", 422),
    ("command_error", "conflict: a exists and is a fifo", 409),
    ("command_error", "is a directory: a; upload a tar to fill a directory", 409),
    ("command_error", "not a directory: a/b", 409),
    ("command_error", "permission denied: a is not writable", 403),
    ("command_error", "no such exec 0123456789abcdef", 409),
    ("server_unavailable", "the exec queue is full: 8 run, 64 wait", 429),
    ("server_unavailable", "the agent is stopping", 503),
])
def test_agent_errors_map_to_statuses(code: str, message: str, status: int) -> None:
    error = reploy_serve.serve_error_for(reploy_serve.AgentCallError(code, message))
    assert error.status == status and error.code in reploy_serve.ERROR_CODES
    words = {"no such file": "not_found", "permission denied": "permission_denied", "is a directory": "is_a_directory",
             "not a directory": "not_a_directory", "too large": "too_large", "cannot run": "cannot_run"}
    assert error.code == next((c for w, c in words.items() if message.startswith(w)), error.code)


# -- the `session exec` and `session cp` clients ---------------------------------------------------


def exec_args(**extra: object) -> SimpleNamespace:
    return SimpleNamespace(**{"timeout": "60s", "cwd": "", "env": [], "stdin": False, "raw": False,
                              "detach": False, "command_line": None, **extra})


def test_session_exec_bodies() -> None:
    body = reploy_serve.exec_request_body(exec_args(cwd="src", env=["A=1", "B=x=y"], timeout="5m"), ["make", "test"])
    assert body == {"argv": ["make", "test"], "timeoutMs": 300_000, "cwd": "src", "env": {"A": "1", "B": "x=y"}}
    args = SimpleNamespace(session_action="exec", id="x", exec_body=body)
    assert reploy_serve.client_request(args) == ("POST", "/sessions/x/exec", body)
    assert reploy_serve.exec_request_body(exec_args(command_line="ls -l | wc -l"), [])["argv"] == [
        "sh", "-c", "ls -l | wc -l"]
    assert reploy_serve.exec_request_body(exec_args(detach=True), ["sleep", "9"])["detach"] is True
    for bad, argv in ((exec_args(), []), (exec_args(env=["=1"]), ["a"]), (exec_args(timeout="2d"), ["a"]),
                      (exec_args(timeout="25h"), ["a"]), (exec_args(command_line="ls"), ["ls"]),
                      (exec_args(detach=True, raw=True), ["a"])):
        with pytest.raises(reploy.UsageError):
            reploy_serve.exec_request_body(bad, argv)


def test_copy_operands() -> None:
    sid = "0123456789abcdef"
    assert reploy_serve.parse_copy_operand(f"{sid}:src/a.txt") == (sid, "workspace", "src/a.txt")
    assert reploy_serve.parse_copy_operand(f"{sid}:") == (sid, "workspace", "")
    assert reploy_serve.parse_copy_operand(f"{sid}:~/.config") == (sid, "home", ".config")
    assert reploy_serve.parse_copy_operand(f"{sid}:~") == (sid, "home", "")
    assert reploy_serve.parse_copy_operand("./0123456789abcdef:x") == (None, "", "./0123456789abcdef:x")
    assert reploy_serve.parse_copy_operand("-") == (None, "", "-")
    with pytest.raises(reploy.UsageError, match="relative to its workspace"):
        reploy_serve.parse_copy_operand(f"{sid}:/etc/passwd")


def test_an_archive_built_by_write_tree_tar_passes_the_upload_rules(tmp_path: Path) -> None:
    """What `session cp DIR ID:` sends (the agent's tree writer) is what the agent accepts."""
    (tmp_path / "d/sub").mkdir(parents=True)
    (tmp_path / "d/a.txt").write_text("a")
    (tmp_path / "d/sub/b").write_text("b")
    (tmp_path / "d/in").symlink_to("a.txt")
    (tmp_path / "d/out").symlink_to("/etc")
    buffer = io.BytesIO()
    fd = agent.os.open(tmp_path / "d", agent.os.O_RDONLY | agent.os.O_DIRECTORY)
    try:
        assert agent.write_tree_tar(fd, buffer) == 1  # the escaping symlink is left out
    finally:
        agent.os.close(fd)
    with tarfile.open(fileobj=io.BytesIO(buffer.getvalue())) as archive:
        names = [name for name, _ in agent.vet_upload_members(archive.getmembers())]
    assert sorted(names) == ["a.txt", "in", "sub", "sub/b"] and names[-1] == "in"  # symlinks last


def test_only_the_upload_route_takes_raw_bodies_past_the_access_check() -> None:
    token = "t" * 40
    policy = reploy_serve.AccessPolicy(token, frozenset({"127.0.0.1"}))
    sid = "0123456789abcdef"

    def decide(method: str, target: str, content_type: str) -> object:
        headers = [("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {token}"),
                   ("Content-Type", content_type), ("Content-Length", "5")]
        return reploy_serve.decide_access(method, target, headers, policy)

    for content_type in ("application/octet-stream", "application/x-tar", "application/x-tar; x=1"):
        assert decide("PUT", f"/api/v1/sessions/{sid}/files/a/b?root=home", content_type) is None
    for method, target, content_type in (
            ("PUT", f"/api/v1/sessions/{sid}/files/a", "text/plain"),
            ("POST", f"/api/v1/sessions/{sid}/exec", "application/octet-stream"),
            ("POST", f"/api/v1/sessions/{sid}/write", "application/x-tar"),
            ("GET", f"/api/v1/sessions/{sid}/files/a", "application/octet-stream"),
            ("PUT", "/api/v1/sessions/not-an-id/files/a", "application/octet-stream")):
        with pytest.raises(reploy_serve.UnsupportedMediaType):
            decide(method, target, content_type)


def test_a_request_line_the_agent_would_refuse_is_never_sent(tmp_path: Path) -> None:
    """Escaped JSON can grow a body that fits serve's bound past the agent's line: refused here,
    413 with its reason, before any connection (the agent dir does not even exist)."""
    argv = ["true", *(["\x01" * 65536] * 24)]  # 1.5 MiB of argv, 9 MiB as JSON
    with pytest.raises(reploy_serve.AgentCallError) as refused:
        reploy_serve.agent_call(tmp_path / "none", "exec", {"argv": argv})
    assert refused.value.transport is False and str(refused.value).startswith("too large: ")
    error = reploy_serve.serve_error_for(refused.value)
    assert (error.status, error.code) == (413, "too_large")


def test_exec_output_is_held_then_spooled_and_reads_across_the_seam(tmp_path: Path) -> None:
    output = agent.ExecOutput(agent.EXEC_HELD_BYTES + 1000, tmp_path)
    data = bytes(range(256)) * ((agent.EXEC_HELD_BYTES + 2000) // 256 + 1)
    for start in range(0, len(data), 65536):
        output.feed(data[start:start + 65536])
    kept = data[:agent.EXEC_HELD_BYTES + 1000]
    assert (output.size_bytes, output.truncated) == (len(kept), True)
    seam = agent.EXEC_HELD_BYTES
    assert output.read(seam - 10, 20) == kept[seam - 10:seam + 10]  # memory, then the spool
    assert output.read(0, len(kept) + 5) == kept and output.read(len(kept), 10) == b""
    output.close()
    assert list(tmp_path.iterdir()) == []  # the spool was an unnamed file
