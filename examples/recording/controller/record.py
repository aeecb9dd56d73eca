"""The recording controller: a scripted shell session in the workload, recorded as asciicast v2.

Runs in the controller container as `record [--columns N --rows N]` (default 120x40, the size of
the recording; the controller resizes the workload's terminal to it). Needs --output-dir.

The one terminal attachment runs inside unmodified asciinema 2.x. The controller container has no
TTY, so util-linux `script` gives asciinema one, as in the seed's OmegaFlow example:

    script --quiet --return --echo never --command \\
      "asciinema rec --quiet --overwrite --cols 120 --rows 40 \\
         --command 'reploy-session-client attach --socket SOCKET' \\
         $REPLOY_OUTPUT_DIR/session.cast" /dev/null

The controller types into script's stdin and reads the terminal back from script's stdout, so what
it drives is exactly what asciinema records. Command completion is read from the shell prompt,
which the controller sets to carry the exit status between colour codes that the echo of typed
text can never contain. After the attachment ends (asciinema has closed the cast), it writes
report.json, sends complete, keeps the terminated result in terminated.json and acknowledges.
Terminal output is workload data: it is matched, never trusted for lifecycle facts.
"""

import argparse
import json
import os
import shlex
import sys
from typing import Any, Callable

from reploy_driver import SessionDriver, SessionFailed

#: Typed first: the prompt becomes "[STATUS] rec$ " in green. The typed text holds `\033`
#: spelt out, so only the prompt the shell prints matches PROMPT_RE.
SET_PROMPT = "PS1=\"$(printf '\\033[32m')[\\$?] rec\\$ $(printf '\\033[0m')\""
PROMPT_RE = rb"\x1b\[32m\[(\d+)\] rec\$ \x1b\[0m"

#: The scripted session, typed one line at a time, each after the previous prompt.
COMMANDS = ("cat README", "ls -l", "./countdown.sh 3", "echo $((6 * 7))", "uname -s")

CAST_NAME = "session.cast"
REPORT_NAME = "report.json"
TERMINATED_NAME = "terminated.json"


class RecordingSession(SessionDriver):
    """A SessionDriver whose attachment runs inside asciinema, under `script` for a PTY.

    `before_complete` runs right before `complete` is sent, whichever way the session ended, so
    the artifacts are final when the host is told they are; `store_terminated` gets the
    `terminated` event before it is acknowledged.
    """

    def __init__(self, cast_path: str, columns: int, rows: int,
                 before_complete: Callable[[], None],
                 store_terminated: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(attach="pipe", columns=columns, rows=rows,
                         wrap_attach=self.under_recorder)
        self.cast_path = cast_path
        self._before_complete = before_complete
        self._store_terminated = store_terminated

    def under_recorder(self, attach_argv: list[str]) -> list[str]:
        """asciinema records the attachment; `script` gives it the PTY it needs. The socket
        path comes from the decoded broker-ready event and is quoted, never parsed out of
        terminal output."""
        record = shlex.join(["asciinema", "rec", "--quiet", "--overwrite",
                             "--cols", str(self.columns), "--rows", str(self.rows),
                             "--command", shlex.join(attach_argv), self.cast_path])
        return ["script", "--quiet", "--return", "--echo", "never", "--command", record,
                "/dev/null"]

    def send(self, request_type: str, **fields: Any) -> None:
        if request_type == "complete":
            self._before_complete()
        elif request_type == "acknowledge-terminated":
            self._store_terminated(self.events[-1])
        super().send(request_type, **fields)


def cast_facts(path: str) -> dict[str, Any]:
    """What the finished cast holds: its header and how many events, read back, not assumed."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return {"error": f"cannot read the cast: {e}"}
    if not lines:
        return {"error": "the cast is empty"}
    header = json.loads(lines[0])
    return {"version": header.get("version"), "width": header.get("width"),
            "height": header.get("height"), "events": len(lines) - 1,
            "duration_s": json.loads(lines[-1])[0] if len(lines) > 1 else 0.0,
            "bytes": os.path.getsize(path)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="record")
    parser.add_argument("--columns", type=int, default=120)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args(argv)
    os.environ.setdefault("TERM", "xterm-256color")  # the recorder and its PTY want a TERM
    output_dir = os.environ.get("REPLOY_OUTPUT_DIR")
    if not output_dir:
        print("record: run the session with --output-dir; the cast needs somewhere to go",
              file=sys.stderr)
        return 2
    report: dict[str, Any] = {"cast": CAST_NAME, "columns": args.columns, "rows": args.rows,
                              "commands": [], "error": None}

    def write_report() -> None:
        report["recorder_exit"] = session.attach.returncode if session.attach else None
        report["events"] = [event["type"] for event in session.events]
        report["cast_facts"] = cast_facts(os.path.join(output_dir, CAST_NAME))
        with open(os.path.join(output_dir, REPORT_NAME), "w") as f:
            json.dump(report, f, indent=2)

    def store_terminated(terminated: dict[str, Any]) -> None:
        with open(os.path.join(output_dir, TERMINATED_NAME), "w") as f:
            json.dump(terminated, f, indent=2)

    session = RecordingSession(os.path.join(output_dir, CAST_NAME), args.columns, args.rows,
                               before_complete=write_report, store_terminated=store_terminated)
    with session:
        try:
            opened = session.start()
            if (opened["columns"], opened["rows"]) != (args.columns, args.rows):
                session.send("resize", columns=args.columns, rows=args.rows)
            session.type(SET_PROMPT + "\n")
            session.expect(PROMPT_RE)
            for command in COMMANDS:
                session.type(command + "\n")
                status = int(session.expect(PROMPT_RE).group(1))
                report["commands"].append({"command": command, "exit_status": status})
                print(f"record: {command!r} exited {status}", file=sys.stderr)
            session.type("exit 0\n")
        except SessionFailed as e:
            report["error"] = str(e)
            seen = {event["type"] for event in session.events}
            if session.close_if_never_ready():
                print(f"record: the session never became ready: {e}", file=sys.stderr)
                return 1
            # Keep what was recorded: end the session properly and report the failure.
            print(f"record: {e}; terminating the session", file=sys.stderr)
            if "terminating" not in seen:
                session.send("terminate")
        try:
            outcome = session.finish()
        except SessionFailed as e:
            print(f"record: the session did not end cleanly: {e}", file=sys.stderr)
            return 1
    print(f"record: {CAST_NAME}, {REPORT_NAME} and {TERMINATED_NAME} are in the output directory",
          file=sys.stderr)
    clean = outcome.client_exit == 0 and report["error"] is None
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
