#!/usr/bin/env python3
"""A stand-in for the Claude Code CLI in agent.py's tests: it speaks stream-json and never calls a model.

Invoked like the real one (`[--continue] [--model M] ... -- PROMPT`, or with no `-- PROMPT` and the prompt on stdin);
the prompt names a scenario and its argument:

  say TEXT          one assistant message, TEXT split into several text_delta events, then a result
  args              says its own argv as JSON (so tests see --continue and --model)
  measure ...       says how the prompt came (argv or stdin), its size in bytes and its sha256, as JSON
  stderr TEXT       "after stderr" on stdout in two deltas, with TEXT on stderr in between (mid-line)
  plain TEXT        TEXT as a non-JSON stdout line
  result TEXT       only a result event
  error TEXT        one delta, then a result with is_error true and TEXT, exit status 0 (the real CLI exits 1)
  secret            the value of FAKE_SECRET, split across two deltas and two writes, and on stderr in two writes
  utf8              "é€😀" on stderr with every code point split across writes, then one invalid byte
  big N             N bytes of "x" as deltas
  fail              a diagnostic on stderr, exit status 3
  hang              one delta, then waits forever
  grandchild FILE   starts a grandchild that sleeps forever, writes its pid to FILE, then waits forever
  write FILE TEXT   writes TEXT into FILE (relative to the workspace), says done
  probe ...         says, as JSON, how the prompt came, its stdin's access mode, what linking its stdin into the
                    workspace answered, and its capability sets
  model TEXT        asks the Messages API at $ANTHROPIC_BASE_URL (as the real CLI does: POST
                    /v1/messages?beta=true, streaming, the placeholder as Authorization: Bearer)
                    and says each text delta as it arrives; an HTTP error or an error event is a
                    result with is_error true and the API's message, exit status 1
"""

import errno
import fcntl
import hashlib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.parse


def emit(document: dict) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def stream(event: dict) -> None:
    emit({"type": "stream_event", "event": event})


def say(*pieces: str, between=lambda: None) -> None:
    """One assistant message of these text deltas, calling between() between each two."""
    stream({"type": "message_start", "message": {"role": "assistant"}})
    stream({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    for number, piece in enumerate(pieces):
        if number:
            between()
        stream({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})
    stream({"type": "content_block_stop", "index": 0})
    stream({"type": "message_stop"})


def write_raw(stream_file, data: bytes) -> None:
    stream_file.buffer.write(data)
    stream_file.buffer.flush()
    time.sleep(0.05)  # the fake's own pacing, so the agent is likely to see separate reads


def api_error(message: str) -> int:
    """What the real CLI does with an API error: an error result (and a diagnostic), exit 1."""
    sys.stderr.write(f"API Error: {message}\n")
    sys.stderr.flush()
    emit({"type": "result", "subtype": "success", "is_error": True, "result": f"API Error: {message}"})
    return 1


def ask_model(prompt: str) -> int:
    """One streaming request, the real CLI's shape; the answer's deltas go out as they arrive."""
    base = urllib.parse.urlsplit(os.environ["ANTHROPIC_BASE_URL"])
    body = json.dumps({"model": "fake", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": prompt}]})
    connection = http.client.HTTPConnection(base.hostname, base.port, timeout=60)
    try:
        connection.request("POST", "/v1/messages?beta=true", body=body, headers={
            "content-type": "application/json", "anthropic-version": "2023-06-01",
            "authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"]})
        response = connection.getresponse()
    except OSError as e:
        return api_error(str(e))
    if response.status != 200:
        return api_error(f"{response.status} {json.loads(response.read())['error']['message']}")
    stream({"type": "message_start", "message": {"role": "assistant"}})
    stream({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    event = ""
    while line := response.readline():
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            if event == "error":
                return api_error(data["error"]["message"])
            if data.get("type") == "content_block_delta":
                stream({"type": "content_block_delta", "index": 0, "delta": data["delta"]})
    stream({"type": "content_block_stop", "index": 0})
    stream({"type": "message_stop"})
    return 0


def result_only(text: str, is_error: bool) -> None:
    """The `result` and `error` scenarios: an error comes after a partial answer, as a cut-off one does."""
    if is_error:
        say("partial answer")
    emit({"type": "result", "subtype": "success", "is_error": is_error, "result": text})


def wait_forever() -> None:
    while True:
        time.sleep(3600)


def probe_self(via: str) -> dict:
    """What a run can do with what it was given (see the `probe` scenario)."""
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:  # linkat(AT_SYMLINK_FOLLOW) of the magic link fd/0: what would give the agent's file a name here
        os.link("fd/0", "linked-stdin", src_dir_fd=proc, follow_symlinks=True)
        link = "linked"
    except OSError as e:
        link = errno.errorcode[e.errno]
    finally:
        os.close(proc)
    modes = {os.O_RDONLY: "read-only", os.O_WRONLY: "write-only", os.O_RDWR: "read-write"}
    return {"via": via, "stdin": modes[fcntl.fcntl(0, fcntl.F_GETFL) & os.O_ACCMODE], "link": link,
            "caps": {name: status[name].strip() for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}}


def main() -> int:
    argv = sys.argv[1:]
    if "--" in argv:
        prompt, via = argv[argv.index("--") + 1], "argv"
    else:
        prompt, via = sys.stdin.buffer.read().decode(), "stdin"
    scenario, _, argument = prompt.partition(" ")
    emit({"type": "system", "subtype": "init", "session_id": "fake"})
    if scenario == "say":
        third = max(len(argument) // 3, 1)
        say(argument[:third], argument[third:2 * third], argument[2 * third:])
    elif scenario == "args":
        say(json.dumps(argv))
    elif scenario == "measure":
        data = prompt.encode()
        say(json.dumps({"via": via, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    elif scenario == "probe":
        say(json.dumps(probe_self(via)))
    elif scenario == "stderr":
        def diagnose() -> None:
            time.sleep(0.05)  # the fake's own pacing, so the agent likely reads "after " before the diagnostic
            write_raw(sys.stderr, (argument + "\n").encode())
        say("after ", "stderr", between=diagnose)
    elif scenario == "plain":
        print(argument, flush=True)
    elif scenario in ("result", "error"):
        result_only(argument, is_error=scenario == "error")
        return 0
    elif scenario == "secret":
        secret = os.environ["FAKE_SECRET"]
        half = len(secret) // 2
        say("token=" + secret[:half], secret[half:] + " end")
        write_raw(sys.stderr, ("err:" + secret[:half]).encode())
        write_raw(sys.stderr, (secret[half:] + "\n").encode())
    elif scenario == "utf8":
        for char in "é€😀":
            data = char.encode()
            write_raw(sys.stderr, data[:1])
            write_raw(sys.stderr, data[1:])
        write_raw(sys.stderr, b"\xff\n")
    elif scenario == "big":
        total = int(argument)
        chunk = 1000
        say(*["x" * min(chunk, total - start) for start in range(0, total, chunk)])
    elif scenario == "fail":
        sys.stderr.write("fake: something broke\n")
        return 3
    elif scenario == "model":
        if ask_model(argument):
            return 1
    elif scenario == "hang":
        say("working")
        wait_forever()
    elif scenario == "grandchild":
        child = subprocess.Popen(["sleep", "1000"])
        with open(argument + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.rename(argument + ".tmp", argument)
        say("spawned")
        wait_forever()
    elif scenario == "write":
        name, _, text = argument.partition(" ")
        with open(name, "w") as f:
            f.write(text)
        say("done")
    else:
        sys.stderr.write(f"fake: unknown scenario {scenario!r}\n")
        return 2
    emit({"type": "result", "subtype": "success", "is_error": False, "result": "final result text"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
