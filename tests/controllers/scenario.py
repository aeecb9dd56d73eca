"""The test controller: runs one named scenario inside the controller container and writes
what it observed to $REPLOY_OUTPUT_DIR/report.json. The tests read the report and the host's
result; nothing here decides pass or fail on its own beyond recording facts.

  python3 /opt/controller/scenario.py full --attach pipe|pty
  python3 /opt/controller/scenario.py terminate --attach pipe
"""

import argparse
import json
import os
import re
import sys
import traceback

from reploy_driver import SessionDriver

RAW_BYTES = bytes([0x00, 0x7F, 0xFF, 0x1B, 0x03, 0x04, 0x11, 0x13])
BIG_OUTPUT_LINES = 30000  # `seq 1 30000`: 168,894 bytes, more than 160 KiB


def wait_for_size(session, rows, columns, attempts=50):
    """`stty size` until the workload PTY reports the size (a resize is asynchronous)."""
    for _ in range(attempts):
        status, output = session.run("stty size")
        if status == 0 and f"{rows} {columns}".encode() in output:
            return True
    return False


def full(session, report):
    checks = report["checks"]
    opened = session.start()
    report["opened"] = opened
    # Two commands: the cwd persists between them.
    session.run("cd /tmp")
    status, output = session.run("pwd")
    checks["cwd_persists"] = status == 0 and b"/tmp\r\n" in output
    # Ctrl-C interrupts a foreground job, and the shell comes back. The marker is printed by
    # the shell after its line editor has restored the terminal, so ISIG is on when 0x03 goes.
    session.type("echo @@sleeping-$((40+2))@@; sleep 30\n")
    session.expect(rb"@@sleeping-42@@")
    session.type(b"\x03")
    status, output = session.run("echo back")
    checks["interrupt_returns_shell"] = b"back" in output
    # Raw bytes out of the workload arrive unchanged.
    status, output = session.run(r"printf '\001\377\033[0m|'")
    checks["raw_output_bytes"] = b"\x01\xff\x1b[0m|" in output
    # Raw bytes into the workload arrive unchanged (line discipline in raw mode).
    session.type("stty raw -echo; echo @@raw-$((40+2))@@; head -c 8 | od -An -tx1; stty sane\n")
    session.expect(rb"@@raw-42@@")
    session.type(RAW_BYTES)
    match = session.expect(rb"((?:[0-9a-f]{2}\s+){7}[0-9a-f]{2})")
    checks["raw_input_bytes"] = bytes.fromhex(match.group(1).decode()) == RAW_BYTES
    session.run("true")
    # A large output arrives complete and in order.
    status, output = session.run(f"seq 1 {BIG_OUTPUT_LINES}")
    numbers = [int(n) for n in re.findall(rb"^(\d+)\r?$", output, re.M)]
    checks["big_output_in_order"] = numbers == list(range(1, BIG_OUTPUT_LINES + 1))
    report["big_output_bytes"] = len(output)
    # Structured resize, seen by the workload.
    session.send("resize", columns=100, rows=30)
    checks["structured_resize"] = wait_for_size(session, 30, 100)
    if session.attach_mode == "pty":
        session.resize_local_terminal(120, 40)
        checks["sigwinch_resize"] = wait_for_size(session, 40, 120)
    session.type("exit 0\n")
    return session.finish()


def terminate(session, report):
    session.start()
    status, output = session.run("echo still-here")
    report["checks"]["shell_answered"] = b"still-here" in output
    session.type("sleep 1000\n")
    session.expect(rb"sleep 1000\r?\n")
    session.send("terminate")
    session.send("terminate")  # repeated terminate is idempotent
    return session.finish()


SCENARIOS = {"full": full, "terminate": terminate}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--attach", choices=("pipe", "pty"), default="pipe")
    args = parser.parse_args()
    report = {"scenario": args.scenario, "attach": args.attach, "checks": {}, "error": None}
    code = 1
    with SessionDriver(attach=args.attach, timeout_s=30) as session:
        try:
            outcome = SCENARIOS[args.scenario](session, report)
            report.update(events=outcome.events, terminated=outcome.terminated,
                          client_exit=outcome.client_exit, attach_exit=outcome.attach_exit)
            code = 0
        except Exception:  # the report must say what went wrong, whatever it was
            report["error"] = traceback.format_exc()
            report["events"] = session.events
            report["transcript_tail"] = session.transcript[-2000:].decode(errors="replace")
    with open(os.path.join(os.environ["REPLOY_OUTPUT_DIR"], "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["checks"]), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
