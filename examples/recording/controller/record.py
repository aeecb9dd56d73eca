"""The recording controller: a scripted shell session in the workload, recorded as asciicast v2,
with a browser step against the workload's endpoint while its shell stays live.

Runs in the controller container as `record [--columns N --rows N]` (default 120x40, the size of
the recording; the controller resizes the workload's terminal to it). Needs --output-dir and the
workload endpoint `web` (--endpoint web).

The one terminal attachment runs inside unmodified asciinema 2.x. The controller container has no
TTY, so util-linux `script` gives asciinema one, as in the seed's OmegaFlow example:

    script --quiet --return --echo never --command \\
      "asciinema rec --quiet --overwrite --cols 120 --rows 40 \\
         --command 'reploy-session-client attach --socket SOCKET' \\
         $REPLOY_OUTPUT_DIR/session.cast" /dev/null

The controller types into script's stdin and reads the terminal back from script's stdout, so what
it drives is exactly what asciinema records. Command completion is read from the shell prompt,
which the controller sets to carry the exit status between colour codes that the echo of typed
text can never contain.

The browser step is the seed's terminal-to-browser handoff: the controller has the workload's
shell serve a page carrying a fresh marker on the granted endpoint, and while that shell waits at
its prompt, screenshot.js opens the page in headless Chromium (Playwright over pipes) and keeps
page.png and page.json. The shell then stops the server and exits.

After the attachment ends (asciinema has closed the cast), it writes report.json, sends complete,
keeps the terminated result in terminated.json and acknowledges. Terminal output and the page are
workload data: they are matched and recorded, never trusted for lifecycle facts.
"""

import argparse
import json
import os
import secrets
import shlex
import struct
import subprocess
import sys
from typing import Any, Callable

from reploy_driver import SessionDriver, SessionFailed

#: Typed first: the prompt becomes "[STATUS] rec$ " in green. The typed text holds `\033`
#: spelt out, so only the prompt the shell prints matches PROMPT_RE.
SET_PROMPT = "PS1=\"$(printf '\\033[32m')[\\$?] rec\\$ $(printf '\\033[0m')\""
PROMPT_RE = rb"\x1b\[32m\[(\d+)\] rec\$ \x1b\[0m"

#: The scripted session, typed one line at a time, each after the previous prompt.
COMMANDS = ("cat README", "ls -l", "./countdown.sh 3", "echo $((6 * 7))", "uname -s")

#: The workload endpoint the browser opens; the workload's serve.sh listens on its port.
ENDPOINT_ID = "web"
SCREENSHOT_SCRIPT = "/opt/controller/screenshot.js"
#: The whole browser step: Chromium's start, the page load and the screenshot.
BROWSER_TIMEOUT_S = 120

CAST_NAME = "session.cast"
SCREENSHOT_NAME = "page.png"
PAGE_NAME = "page.json"
REPORT_NAME = "report.json"
TERMINATED_NAME = "terminated.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def png_facts(path: str) -> dict[str, Any]:
    """What the screenshot is, read back from its header: a PNG of which size."""
    try:
        with open(path, "rb") as f:
            header = f.read(24)
    except OSError as e:
        return {"error": f"cannot read the screenshot: {e}"}
    if header[:8] != PNG_SIGNATURE or header[12:16] != b"IHDR":
        return {"error": "the screenshot is not a PNG"}
    width, height = struct.unpack(">II", header[16:24])
    return {"width": width, "height": height, "bytes": os.path.getsize(path)}


def run_command(session: SessionDriver, command: str, report: dict[str, Any]) -> int:
    """Type one command line and wait for the next prompt; returns the exit status it shows."""
    session.type(command + "\n")
    status = int(session.expect(PROMPT_RE).group(1))
    report["commands"].append({"command": command, "exit_status": status})
    print(f"record: {command!r} exited {status}", file=sys.stderr)
    return status


def browser_step(session: SessionDriver, endpoint: dict[str, Any], output_dir: str,
                 report: dict[str, Any]) -> None:
    """The workload's shell serves a page with a fresh marker; while the shell stays live at its
    prompt, headless Chromium opens it through the granted endpoint and keeps page.png and
    page.json; then the shell stops the server (it answers, so it outlived the browser)."""
    marker = f"rec-{secrets.token_hex(6)}"
    url = f"{endpoint['scheme']}://{endpoint['host']}:{endpoint['port']}/"
    screenshot = os.path.join(output_dir, SCREENSHOT_NAME)
    browser: dict[str, Any] = {"marker": marker, "url": url, "screenshot": SCREENSHOT_NAME,
                               "page": PAGE_NAME, "exit_status": None}
    report["browser"] = browser
    if run_command(session, f"./serve.sh {marker}", report) != 0:
        raise SessionFailed("the workload's shell could not serve the page")
    try:
        proc = subprocess.run(["node", SCREENSHOT_SCRIPT, url, screenshot,
                               os.path.join(output_dir, PAGE_NAME)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SessionFailed(f"the browser step took longer than {BROWSER_TIMEOUT_S} s") from None
    browser["exit_status"] = proc.returncode
    browser["png_facts"] = png_facts(screenshot)
    if proc.returncode != 0:
        raise SessionFailed(f"the browser step failed ({proc.returncode}): "
                            f"{proc.stderr.decode(errors='replace')[-1000:]}")
    run_command(session, "killall httpd", report)


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
                              "commands": [], "browser": None, "error": None}

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
            endpoint = session.granted_endpoint(opened, ENDPOINT_ID)
            if (opened["columns"], opened["rows"]) != (args.columns, args.rows):
                session.send("resize", columns=args.columns, rows=args.rows)
            session.type(SET_PROMPT + "\n")
            session.expect(PROMPT_RE)
            for command in COMMANDS:
                run_command(session, command, report)
            browser_step(session, endpoint, output_dir, report)
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
    print(f"record: in the output directory: {', '.join(sorted(os.listdir(output_dir)))}",
          file=sys.stderr)
    clean = outcome.client_exit == 0 and report["error"] is None
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
