"""A controller written the way an outside integrator writes one: it speaks only the public
JSON Lines stream of `reploy-session-client client` and runs `attach` over pipes, with no
Reploy code at all. It keeps every event line exactly as it arrived, so the test can check
them with its own strict reading of the contract (tests/contract_rules.py).

  python3 strict_consumer.py MODE [ARG]

It writes $REPLOY_OUTPUT_DIR/events.jsonl (the raw lines) and consumer.json (what it did and
what it saw). Moments the test must meet are named through the `to-test` FIFO, as in
scenario.py. Modes:

  exit CODE        the shell exits with CODE; the robust sequence follows
  terminate        the controller sends terminate while a command runs
  hold             tell the test `active`, then follow the session to its end
  die              exit abruptly once ready
  early-complete   send complete before termination: the client fails the stream and exits
  no-attach        start the client and never attach
  stall            never start the client (the host's startup timeout ends it)
  exit-early       exit 5 without starting the client
  size             the workload's first command is `stty size`; then the shell exits 0
  no-complete      never send complete
  trap-term        a shell that traps SIGTERM and sleeps 5 s on it; terminate, then tell the
                   test `terminating` (it suspends the host past the output deadline)
  exit-later       the shell runs `sleep 5; exit 0` (an interactive shell ignores SIGTERM);
                   terminate, then tell the test `terminating` (it suspends the host in its
                   termination grace, and the shell exits meanwhile)
  stalled-flood    a shell that writes without end to an attachment that is stopped; terminate,
                   tell the test `terminating`; the attachment resumes once output
                   finalization is announced
  burst            stop the attachment; the shell writes 300 kB and exits; on `terminating`
                   tell the test, and resume the attachment at its word (the host is away)
  hold-then-exit   tell the test `active`, wait for its word, then the shell exits 0
  ack-wait         the shell exits 0; on terminated tell the test `terminated` and acknowledge
                   only if its word is `ack`
  late-ack         never attach; read opened and terminated (the test cancels the startup),
                   acknowledge only after the broker's attach deadline would have passed
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

SCHEMA = "reploy-controlled-session-client-v1"


class Consumer:
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.lines = []
        self.notes = {"sequence_errors": [], "requests": []}
        self.client = subprocess.Popen(["reploy-session-client", "client"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.attach = None
        self.output = bytearray()
        self.output_cond = threading.Condition()

    def next_event(self):
        line = self.client.stdout.readline()
        if not line:
            return None
        self.lines.append(line)
        return json.loads(line)

    def expect(self, *types):
        event = self.next_event()
        if event is None or event["type"] not in types:
            got = None if event is None else event["type"]
            self.notes["sequence_errors"].append(f"expected {'|'.join(types)}, got {got}")
            raise SystemExit(self.finish(1))
        return event

    def send(self, request_type):
        self.notes["requests"].append(request_type)
        line = json.dumps({"schema": SCHEMA, "type": request_type}, separators=(",", ":"))
        try:
            self.client.stdin.write(line.encode() + b"\n")
            self.client.stdin.flush()
        except BrokenPipeError:
            self.notes["sequence_errors"].append(f"could not send {request_type}")

    def start_attach(self, terminal_socket):
        self.attach = subprocess.Popen(
            ["reploy-session-client", "attach", "--socket", terminal_socket],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self):
        while True:
            data = os.read(self.attach.stdout.fileno(), 65536)
            with self.output_cond:
                if not data:
                    self.output_cond.notify_all()
                    return
                self.output += data
                self.output_cond.notify_all()

    def type(self, text):
        self.attach.stdin.write(text.encode())
        self.attach.stdin.flush()

    def wait_output(self, marker, timeout_s=30):
        with self.output_cond:
            if not self.output_cond.wait_for(lambda: marker in self.output, timeout_s):
                self.notes["sequence_errors"].append(f"no {marker!r} in the terminal output")
                raise SystemExit(self.finish(1))

    def open_session(self):
        ready = self.expect("broker-ready")
        self.start_attach(ready["terminal_socket"])
        self.notes["opened"] = self.expect("opened")
        if self.expect("ready", "terminated")["type"] == "terminated":
            # The startup-failure branch: no complete, acknowledge at once (seed 000).
            self.send("acknowledge-terminated")
            raise SystemExit(self.finish())

    def follow_to_end(self):
        """Steps 4-7 of the seed's robust sequence, refusing any event out of its order:
        after workload-outputs-finalized the controller sends complete, and the next event
        must be terminated."""
        while True:
            event = self.expect("workload-exit", "terminating", "diagnostic",
                                "workload-outputs-finalized")
            if event["type"] == "workload-outputs-finalized":
                break
        self.notes["attach_exit"] = self.attach.wait(timeout=120)
        self.send("complete")
        self.expect("terminated")
        self.send("acknowledge-terminated")

    def finish(self, code=0, close_stdin=True):
        if close_stdin and self.client.stdin and not self.client.stdin.closed:
            try:
                self.client.stdin.close()
            except BrokenPipeError:
                pass
        while self.next_event() is not None:  # whatever else the client says, kept raw
            pass
        self.notes["client_exit"] = self.client.wait(timeout=120)
        if self.attach is not None and "attach_exit" not in self.notes:
            try:
                self.notes["attach_exit"] = self.attach.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.attach.kill()
                self.notes["attach_exit"] = None
        with open(os.path.join(self.out_dir, "events.jsonl"), "wb") as f:
            f.writelines(self.lines)
        with open(os.path.join(self.out_dir, "consumer.json"), "w") as f:
            json.dump(self.notes, f)
        return code


def tell_test(out_dir, moment):
    with open(os.path.join(out_dir, "to-test"), "w") as fifo:
        fifo.write(moment + "\n")


def wait_for_test(out_dir):
    with open(os.path.join(out_dir, "from-test")) as fifo:
        return fifo.readline().strip()


#: How long after broker-ready a late acknowledgement comes: past the broker's 10 s attach
#: deadline (the scenario itself, not a synchronisation).
LATE_ACK_S = 12


def main():  # noqa: C901 (one branch per scenario)
    mode, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    out_dir = os.environ["REPLOY_OUTPUT_DIR"]
    if mode == "stall":
        time.sleep(600)
    if mode == "exit-early":
        return 5
    consumer = Consumer(out_dir)
    if mode == "no-attach":
        consumer.expect("broker-ready")
        return consumer.finish(close_stdin=False)  # the broker's attach deadline ends it
    if mode == "late-ack":
        consumer.expect("broker-ready")
        ready_at = time.monotonic()
        tell_test(out_dir, "broker-ready")
        consumer.expect("opened")
        consumer.expect("terminated")
        time.sleep(max(0.0, ready_at + LATE_ACK_S - time.monotonic()))
        consumer.send("acknowledge-terminated")
        return consumer.finish()
    consumer.open_session()
    if mode == "exit":
        consumer.type(f"exit {int(arg)}\n")
    elif mode == "terminate":
        consumer.type("echo @@$((1+1))@@; sleep 1000\n")
        consumer.wait_output(b"@@2@@")
        consumer.send("terminate")
    elif mode == "hold":
        consumer.type("echo @@$((1+1))@@\n")
        consumer.wait_output(b"@@2@@")
        tell_test(out_dir, "active")
    elif mode == "die":
        os._exit(3)
    elif mode == "early-complete":
        consumer.send("complete")
        return consumer.finish()
    elif mode == "no-complete":
        consumer.type("exit 0\n")
        while consumer.expect("workload-exit", "terminating", "diagnostic",
                              "workload-outputs-finalized")["type"] != "terminating":
            pass
        while consumer.next_event() is not None:
            if consumer.lines and json.loads(consumer.lines[-1])["type"] == "terminated":
                consumer.send("acknowledge-terminated")
        return consumer.finish()
    elif mode == "size":
        consumer.type("stty size; echo @@$((1+1))@@\n")
        consumer.wait_output(b"@@2@@\r\n")
        match = re.search(rb"(\d+ \d+)\r?\n@@2@@", bytes(consumer.output))
        consumer.notes["first_size"] = match.group(1).decode() if match else None
        consumer.type("exit 0\n")
    elif mode == "hold-then-exit":
        consumer.type("echo @@$((1+1))@@\n")
        consumer.wait_output(b"@@2@@")
        tell_test(out_dir, "active")
        wait_for_test(out_dir)
        consumer.type("exit 0\n")
    elif mode == "ack-wait":
        consumer.type("exit 0\n")
        while consumer.expect("workload-exit", "terminating", "diagnostic",
                              "workload-outputs-finalized")["type"] != \
                "workload-outputs-finalized":
            pass
        consumer.notes["attach_exit"] = consumer.attach.wait(timeout=120)
        consumer.send("complete")
        consumer.expect("terminated")
        tell_test(out_dir, "terminated")
        if wait_for_test(out_dir) == "ack":
            consumer.send("acknowledge-terminated")
        return consumer.finish()
    elif mode == "exit-later":
        consumer.type("echo @@$((1+1))@@; sleep 5; exit 0\n")
        consumer.wait_output(b"@@2@@")
        consumer.send("terminate")
        consumer.expect("terminating")
        tell_test(out_dir, "terminating")
    elif mode == "stalled-flood":
        consumer.type("echo @@$((1+1))@@; while :; do echo flood flood flood flood; done\n")
        consumer.wait_output(b"@@2@@")
        os.kill(consumer.attach.pid, signal.SIGSTOP)
        consumer.send("terminate")
        consumer.expect("terminating")
        tell_test(out_dir, "terminating")
        while consumer.expect("workload-exit", "diagnostic",
                              "workload-outputs-finalized")["type"] != \
                "workload-outputs-finalized":
            pass
        os.kill(consumer.attach.pid, signal.SIGCONT)
        consumer.notes["attach_exit"] = consumer.attach.wait(timeout=120)
        consumer.send("complete")
        consumer.expect("terminated")
        consumer.send("acknowledge-terminated")
        return consumer.finish()
    elif mode == "burst":
        consumer.type("echo @@$((1+1))@@; sleep 2; head -c 300000 /dev/zero | tr '\\0' x; "
                      "exit 0\n")
        consumer.wait_output(b"@@2@@")
        os.kill(consumer.attach.pid, signal.SIGSTOP)
        while consumer.expect("workload-exit", "terminating")["type"] != "terminating":
            pass
        tell_test(out_dir, "terminating")
        wait_for_test(out_dir)
        os.kill(consumer.attach.pid, signal.SIGCONT)
    elif mode == "trap-term":
        consumer.type("trap 'sleep 5' TERM; echo @@$((1+1))@@\n")
        consumer.wait_output(b"@@2@@")
        consumer.send("terminate")
        consumer.expect("terminating")
        tell_test(out_dir, "terminating")
    else:
        raise SystemExit(f"unknown mode {mode}")
    consumer.follow_to_end()
    return consumer.finish()


if __name__ == "__main__":
    sys.exit(main())
