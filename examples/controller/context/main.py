"""The demo controller: drives a short shell session in the workload and keeps a transcript.

Runs inside the controller container (python3 /opt/controller/main.py). When the host grants an
output directory (--output-dir), the transcript and the structured result are kept there.
"""

import json
import os
import sys

from reploy_driver import SessionDriver, SessionFailed

def main() -> int:
    with SessionDriver(attach="pipe") as session:
        try:
            opened = session.start()
            print(f"controller: session opened at {opened['columns']}x{opened['rows']}",
                  file=sys.stderr)
            for command in ("./hello.sh", "ls -l", "cd /tmp && pwd", "echo $((6 * 7))"):
                status, _output = session.run(command)
                print(f"controller: {command!r} exited {status}", file=sys.stderr)
            session.type("exit 0\n")
            outcome = session.finish()
        except SessionFailed as e:
            print(f"controller: {e}", file=sys.stderr)
            return 1
    output_dir = os.environ.get("REPLOY_OUTPUT_DIR")
    if output_dir:
        with open(os.path.join(output_dir, "transcript.txt"), "wb") as f:
            f.write(outcome.transcript)
        with open(os.path.join(output_dir, "terminated.json"), "w") as f:
            json.dump(outcome.terminated, f, indent=2)
    sys.stderr.write("controller: transcript follows\n")
    sys.stderr.write(outcome.transcript.decode(errors="replace").replace("\r\n", "\n"))
    sys.stderr.write("\n")
    return 0 if outcome.client_exit == 0 and outcome.attach_exit == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
