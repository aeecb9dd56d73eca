"""The test controller: runs one named scenario inside the controller container and writes
what it observed to $REPLOY_OUTPUT_DIR/report.json (when there is an output directory). The
tests read the report and the host's result; nothing here decides pass or fail on its own
beyond recording facts.

  python3 /opt/controller/scenario.py SCENARIO [--attach pipe|pty]

Scenarios that must meet the test at a precise moment (to kill the host, remove a container,
inspect the live session) tell it through FIFOs the test creates in the output directory:
`to-test` (the controller writes one line naming the moment) and `from-test` (the controller
blocks until the test writes a line back).
"""

import argparse
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import traceback
import urllib.request

from reploy_driver import SessionDriver, SessionFailed

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
    # the job itself, which the shell made the terminal's foreground process group before it
    # ran (and after its line editor restored the terminal): ISIG is on and the job is in the
    # foreground when 0x03 goes. (A marker echoed by the shell before it forks the job raced
    # the hand-over under load: the ^C then reached the shell, and the sleep ran on.)
    session.type("sh -c 'echo @@sleeping-$((40+2))@@; exec sleep 30'\n")
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


#: prompt-loop: the prompt carries the last status; the typed text spells `\$?`, so its echo
#: never matches LOOP_PROMPT_RE, only a prompt the shell prints does.
LOOP_SET_PROMPT = 'PS1="@@\\$?-p@@ "\n'
LOOP_PROMPT_RE = rb"@@(\d+)-p@@ "


#: orphan-loop: each of these loops makes short-lived orphans, which the workload's PID 1 reaps,
#: paced by 2 ms: unpaced, the fork storm once filled the example workload's 128 MiB memory
#: cgroup and the kernel's OOM killer took the shell (exit 137). Paced so, with the shell as
#: PID 1 (no init) the loop still lost a prompt by round 437.
ORPHAN_MAKERS = 4
ORPHAN_MAKER = "(while :; do (sleep 0 &); sleep 0.002; done) >/dev/null 2>&1 &\n"
#: What the shell may print before a prompt about a job that ended (a maker that could not fork).
JOB_NOTICES_RE = rb"(?:\[\d+\][+-]? [^\r\n]*\r\n)*"


def prompt_loop(session, report):
    """Command after command, each answered by its output and then the shell's prompt, as a
    person (or the recording example) drives a shell: --variant is how many rounds."""
    session.start()
    session.type(LOOP_SET_PROMPT)
    session.expect(LOOP_PROMPT_RE)
    return answer_rounds(session, report)


def orphan_loop(session, report):
    """The prompt loop beside loops that make orphans. Were the shell PID 1, it would reap
    them, and an orphan's SIGCHLD that interrupts the write of a prompt loses it (issue 29)."""
    session.start()
    session.type(LOOP_SET_PROMPT)
    session.expect(LOOP_PROMPT_RE)
    for _ in range(ORPHAN_MAKERS):
        session.type(ORPHAN_MAKER)
        session.expect(LOOP_PROMPT_RE)
    return answer_rounds(session, report)


def answer_rounds(session, report):
    """--variant rounds of a command and its answer, each followed by the prompt."""
    report["rounds"] = 0
    for round_number in range(int(report["variant"])):
        session.type(f"echo {round_number}-$((6 * 7))\n")
        session.expect(rb"\r\n%d-42\r\n" % round_number + JOB_NOTICES_RE + LOOP_PROMPT_RE)
        report["rounds"] = round_number + 1
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


def tell_test(moment):
    """Name a moment to the test through the `to-test` FIFO (blocks until it reads)."""
    with open(os.path.join(os.environ["REPLOY_OUTPUT_DIR"], "to-test"), "w") as fifo:
        fifo.write(moment + "\n")


def wait_for_test():
    with open(os.path.join(os.environ["REPLOY_OUTPUT_DIR"], "from-test")) as fifo:
        return fifo.readline().strip()


def hold(session, report):
    """Become active, tell the test, then follow the session to its end like a good controller."""
    session.start()
    session.run("echo active")
    tell_test("active")
    return session.finish()


def hold_then_exit(session, report):
    """Become active, wait for the test's go, then end by the workload's own exit."""
    session.start()
    session.run("echo active")
    tell_test("active")
    wait_for_test()
    session.type("exit 0\n")
    return session.finish()


def exit_code(session, report):
    """The workload's shell exits with a non-zero status."""
    session.start()
    session.type("exit 3\n")
    return session.finish()


def hold_terminating(session, report):
    """Reach terminating (finalized output) and then never send complete."""
    session.start()
    session.send("terminate")
    while session.next_event()["type"] != "workload-outputs-finalized":
        pass
    tell_test("terminating")
    wait_for_test()  # the host is killed meanwhile; this never returns on its own
    raise SessionFailed("the test answered; it should have killed the host")


def stall(session, report):
    """Never connect: the host stays in preparing until its startup timeout."""
    tell_test("preparing")
    wait_for_test()
    raise SessionFailed("the test answered; it should have killed the host")


def no_attach(session, report):
    """Start the broker but never attach: the broker's 10 s deadline ends the session."""
    client = subprocess.Popen(["reploy-session-client", "client"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    lines = [json.loads(line) for line in client.stdout]
    report["events"] = lines
    report["client_exit"] = client.wait()
    return None


def wire_codec():
    """The private framing, from the client the derived image installs (the host's own), as
    its command imports it."""
    sys.path.insert(0, "/usr/local/lib/reploy")
    import reploy_session_client
    return reploy_session_client


def rogue_handover(session, report):
    """Play a broker that hands the host something other than an attachment's connection (as
    --variant says), then follow the channel to its end. Records the events it got and
    whether the host closed every descriptor it was handed."""
    wire = wire_codec()
    variant = report["variant"]
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect(os.environ["REPLOY_SESSION_SOCKET"])
    channel.settimeout(60)
    decoder, events = wire.FrameDecoder(), []

    def next_events():
        """The events of the next frames, or [] once the host closed the channel."""
        while True:
            data = channel.recv(65536)
            if not data:
                return []
            frames = decoder.feed(data)
            if frames:
                return [json.loads(frame.payload) for frame in frames]

    while "opened" not in [e["type"] for e in events]:
        got = next_events()
        if not got:
            raise SessionFailed("the host closed the channel before opened")
        events += got
    kept = []  # our ends of what we hand over: they read end of file once the host closes it
    handed = []
    if variant in ("datagram", "two", "with-request"):
        kind = socket.SOCK_DGRAM if variant == "datagram" else socket.SOCK_STREAM
        for _ in range(2 if variant == "two" else 1):
            near, far = socket.socketpair(socket.AF_UNIX, kind)
            handed.append(near)
            kept.append(far)
    elif variant == "pipe":
        read_end, write_end = os.pipe()
        handed.append(os.fdopen(read_end, "rb"))
        kept.append(os.fdopen(write_end, "wb", buffering=0))
    if variant == "with-request":  # smuggled in with another frame
        frame = wire.encode_frame(wire.FrameKind.REQUEST, wire.Terminate().encode()[:-1])
    else:
        frame = wire.encode_json_frame(wire.FrameKind.ATTACHED, {})
    socket.send_fds(channel, [frame], [h.fileno() for h in handed])
    for h in handed:
        h.close()
    while True:
        got = next_events()
        if not got:
            break
        events += got
        if got[-1]["type"] == "terminated":
            channel.sendall(wire.encode_frame(wire.FrameKind.REQUEST,
                                              wire.AcknowledgeTerminated().encode()[:-1]))
    report["events"] = events
    closed = []
    for end in kept:
        if variant == "pipe":
            try:
                end.write(b"x")
                closed.append(False)
            except BrokenPipeError:
                closed.append(True)
        elif variant == "datagram":
            closed.append(None)  # a datagram pair has no end of file to see
        else:
            end.settimeout(30)
            closed.append(end.recv(1) == b"")
    report["closed_by_host"] = closed
    return None


def die(session, report):
    """The controller process dies while the session is active."""
    session.start()
    session.run("echo alive")
    os._exit(3)


def close_stream(session, report):
    """The controller closes the broker's stdin while active."""
    session.start()
    session.run("echo alive")
    session.client.stdin.close()
    report["client_exit"] = session.client.wait(timeout=30)
    report["events"] = session.drain_events()
    return None


def no_complete(session, report):
    """Reach the point where complete is due and never send it."""
    session.start()
    session.type("exit 0\n")
    while session.next_event()["type"] != "workload-outputs-finalized":
        pass
    terminated = session.next_event("terminated")
    session.send("acknowledge-terminated")
    report["terminated"] = terminated
    report["client_exit"] = session.client.wait(timeout=30)
    return None


def no_ack(session, report):
    """Complete, read terminated, never acknowledge; keep stdin open until the host closes."""
    session.start()
    session.type("exit 0\n")
    while session.next_event()["type"] != "workload-outputs-finalized":
        pass
    session.send("complete")
    report["terminated"] = session.next_event("terminated")
    report["client_exit"] = session.client.wait(timeout=30)
    return None


def linger(session, report):
    """Finish the session properly, then refuse to exit."""
    session.start()
    session.type("exit 0\n")
    outcome = session.finish()
    report.update(events=outcome.events, terminated=outcome.terminated)
    write_report(report)
    wait_for_test()
    return outcome


def output_file(session, report):
    """Write the granted output file as the variant says, then end the session."""
    path = os.environ["REPLOY_OUTPUT_FILE"]
    variant = report["variant"]
    session.start()
    if variant == "regular":
        with open(path, "w") as f:
            f.write("controller artifact\n")
    elif variant == "symlink":
        os.symlink("/etc/passwd", path)
    elif variant == "directory":
        os.mkdir(path)
    elif variant == "abandon":
        with open(path, "w") as f:
            f.write("half written\n")
        os._exit(4)
    elif variant == "deep":  # the file, beside a tree nested deeper than a recursive rmtree goes
        with open(path, "w") as f:
            f.write("controller artifact\n")
        os.chdir(os.path.dirname(path))
        for _ in range(3000):
            os.mkdir("d")
            os.chdir("d")
    session.type("exit 0\n")
    return session.finish()


def serve(session, report):
    """Serve the workload's project through the granted endpoint, check it answers, and hold
    until the test says go (another session probes meanwhile)."""
    opened = session.start()
    report["opened"] = opened
    report["checks"]["endpoint_reachable"] = serve_and_fetch(session, opened)
    return report_and_hold(session, report, "serving")


def isolation(session, report):
    """Everything both containers of a granted session can see of the network, and every
    address of the host they could know, probed from both.

    The test answers the `targets` moment with one JSON line: the port of its own listener
    on the host, the host's interface addresses, other addresses it wants probed, and whether
    to serve the granted endpoint here (not when the port belongs to another session).
    """
    opened = session.start()
    report["opened"] = opened
    tell_test("targets")
    targets = json.loads(wait_for_test())
    checks = report["checks"]
    if targets["serve"]:
        checks["endpoint_reachable"] = serve_and_fetch(session, opened)
    # A listener of the controller's own: the workload shares its loopback, so it reaches it.
    own = socket.socket()
    own.bind(("127.0.0.1", 0))
    own.listen(4)
    status, _ = session.run(workload_connect("127.0.0.1", own.getsockname()[1]))
    checks["workload_reaches_controller_listener"] = status == 0 and accepted(own)
    own.close()
    seen = report["seen"] = network_seen(session)
    names = host_names(session.run("cat /etc/hosts")[1].decode(errors="replace")) | {
        session.run("hostname")[1].decode().splitlines()[-1].strip(), socket.gethostname(),
        "workload"}
    port = targets["port"]
    candidates = sorted(set(targets["addresses"]) | names
                        | {address for view in seen.values() for route in view["routes"]
                           for address in route_addresses(route)})
    report["probed"] = candidates
    report["controller_reached"] = [host for host in candidates if can_connect(host, port)]
    report["workload_reached"] = [
        host for host in candidates
        if session.run(workload_connect(host, port))[0] == 0]
    return report_and_hold(session, report, "probed")


def report_and_hold(session, report, moment):
    """Write the report, name the moment to the test, and end the session on its go."""
    write_report(report)
    tell_test(moment)
    wait_for_test()
    session.type("exit 0\n")
    return session.finish()


def network_seen(session):
    """What each container's kernel lists of its network: interfaces and IPv4 routes."""
    return {"controller": {"interfaces": interfaces(read_text("/proc/net/dev")),
                           "routes": routes(read_text("/proc/net/route"))},
            "workload": {"interfaces": interfaces(session.run("cat /proc/net/dev")[1].decode()),
                         "routes": routes(session.run("cat /proc/net/route")[1].decode())}}


def serve_and_fetch(session, opened):
    """Serve the workload's project on the granted `web` port; fetch it through the grant."""
    grant = session.granted_endpoint(opened, "web")
    session.run(f"httpd -p {grant['port']} -h /project")
    return fetch_granted(grant)


def fetch_granted(grant):
    url = f"{grant['scheme']}://{grant['host']}:{grant['port']}/README"
    return b"stand-in project" in urllib.request.urlopen(url, timeout=10).read()


def holder_loss(session, report):
    """Serve through the grant; the test then kills or removes the namespace holder. Hear the
    host's diagnostic, and show the session's namespace still carries the endpoint and still
    holds nothing but `lo`."""
    opened = session.start()
    checks = report["checks"]
    checks["endpoint_reachable"] = serve_and_fetch(session, opened)
    write_report(report)
    tell_test("serving")
    wait_for_test()
    report["diagnostic"] = session.next_event("diagnostic")
    checks["endpoint_reachable_after_holder_loss"] = fetch_granted(
        session.granted_endpoint(opened, "web"))
    report["seen"] = network_seen(session)
    session.type("exit 0\n")
    return session.finish()


def workload_connect(host, port):
    """The workload's shell command that exits 0 exactly when a TCP connection was made (nc
    runs `true` once connected, so it never waits on the peer)."""
    return f"nc -w 3 {host} {port} -e true >/dev/null 2>&1"


def accepted(listener):
    listener.settimeout(10)
    try:
        listener.accept()[0].close()
        return True
    except OSError:
        return False


def can_connect(host, port):
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def read_text(path):
    with open(path) as f:
        return f.read()


def interfaces(proc_net_dev):
    """The interface names /proc/net/dev lists."""
    return sorted(m.group(1) for m in re.finditer(r"^\s*([\w.@-]+):\s*\d", proc_net_dev, re.M))


def routes(proc_net_route):
    """The IPv4 routes /proc/net/route lists, as (destination, gateway, mask) dotted quads."""
    def quad(field):
        return ".".join(str(b) for b in bytes.fromhex(field)[::-1])
    found = []
    for line in proc_net_route.splitlines():
        fields = line.split()
        if len(fields) >= 8 and all(re.fullmatch(r"[0-9A-F]{8}", f) for f in
                                    (fields[1], fields[2], fields[7])):
            found.append((quad(fields[1]), quad(fields[2]), quad(fields[7])))
    return found


def route_addresses(route):
    """What a route names of the outside: its gateway, and the first address of its network
    (where Docker puts a bridge's gateway)."""
    destination, gateway, mask = route
    first = [int(d) & int(m) for d, m in zip(destination.split("."), mask.split("."))]
    first[3] += 1
    return {address for address in (gateway, ".".join(map(str, first)))
            if address not in ("0.0.0.0", "0.0.0.1")}


def host_names(etc_hosts):
    """Every name and address /etc/hosts gives (the resolvable names a process can know)."""
    found = set()
    for line in etc_hosts.splitlines():
        fields = line.split("#")[0].split()
        if len(fields) >= 2 and "@@" not in line:  # not the echo of the command typed
            found.update(fields)
    return found


def no_network(session, report):
    """Without a grant both containers have only loopback, and no route."""
    session.start()
    report["seen"] = network_seen(session)
    session.type("exit 0\n")
    return session.finish()


def hold_before_broker(session, report):
    """Tell the test the channel is open, wait for its go, and only then start the broker (a
    peer of the test's own may meanwhile try the channel); end by the workload's exit."""
    tell_test("channel-open")
    wait_for_test()
    session.start()
    session.run("echo active")
    session.type("exit 0\n")
    return session.finish()


def audit(session, report):
    """Collect the sandbox facts from inside both containers, then let the test inspect. The
    channel socket is looked at first: the host unlinks it once the broker has claimed it."""
    facts = report.setdefault("controller", {})
    facts["channel_socket"] = entry_facts(os.environ["REPLOY_SESSION_SOCKET"])
    session.start()
    status = open("/proc/self/status").read()
    facts["status"] = {k: v.strip() for k, v in (l.split(":", 1) for l in status.splitlines())
                       if k in ("CapEff", "CapBnd", "CapPrm", "NoNewPrivs", "Seccomp")}
    facts["uid_gid"] = [os.getuid(), os.getgid()]
    facts["environ"] = dict(os.environ)
    facts["root_write"] = try_write("/etc/reploy-probe")
    facts["home_write"] = try_write(os.path.join(os.environ["HOME"], "probe"))
    facts["home"] = entry_facts(os.environ["HOME"])
    facts["docker_socket"] = os.path.exists("/var/run/docker.sock")
    facts["sees_workload_project"] = os.path.exists("/project")
    facts["channel_mount_listing"] = os.listdir("/run/reploy/session")  # unlinked once claimed
    facts["channel_mount_write"] = try_write("/run/reploy/session/probe")
    status_code, output = session.run(
        "grep -E '^(CapEff|CapBnd|CapPrm|NoNewPrivs|Seccomp):' /proc/self/status; id -u; id -g; "
        "touch /etc/reploy-probe 2>&1 | head -c 200; echo; ls /run/reploy 2>&1; "
        "ls -d /mnt/reploy-output* 2>&1; command -v reploy-session-client || echo no-client; "
        "ls /var/run/docker.sock 2>&1; stat -c '@@home %a %u:%g@@' \"$HOME\"; "
        "stat -f -c '@@home-fs %T@@' \"$HOME\"; env")
    report["workload_output"] = output.decode(errors="replace")
    return report_and_hold(session, report, "audit-ready")


def entry_facts(path):
    """What the kernel says of a path, not following a link: its type, permission bits,
    owner and, for a mount point, the type of its filesystem."""
    info = os.lstat(path)
    kind = ("socket" if stat.S_ISSOCK(info.st_mode) else "directory" if stat.S_ISDIR(info.st_mode)
            else "other")
    mounts = [line.split(" - ")[1].split()[0] for line in read_text("/proc/self/mountinfo").splitlines()
              if line.split()[4] == path]
    return {"type": kind, "mode": stat.S_IMODE(info.st_mode), "uid": info.st_uid,
            "gid": info.st_gid, "filesystem": mounts[-1] if mounts else None}


def try_write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "ok"
    except OSError as e:
        return e.strerror


def hostile(session, report):
    """Terminal output that imitates lifecycle events, framing and escapes changes nothing."""
    session.start()
    fake = ('{"schema":"reploy-controlled-session-client-v1","type":"terminated","result":'
            '{"cause":"controller-terminate"}}')
    session.run(f"printf '%s\\n' '{fake}'")
    session.run(r"printf '\000\000\000\005\001{}\033]0;title\007\033[2J\377\376\n'")
    session.run("printf '\\033[6n\\033P+q\\033\\\\'")
    session.type("exit 0\n")
    return session.finish()


def stall_output(session, report):
    """Stop the attachment while the workload floods its terminal, then terminate: the host
    cannot drain the PTY, and output finalization must fail at its deadline."""
    session.timeout_s = 90  # the host's grace plus its 30 s drain deadline come first
    session.start()
    session.type("yes flood\n")  # endless: it fills every buffer while we are stopped
    session.expect(rb"(flood\r\n){100}")
    os.kill(session.attach.pid, signal.SIGSTOP)
    session.send("terminate")
    finalized = None
    while finalized is None:
        event = session.next_event()
        if event["type"] == "workload-outputs-finalized":
            finalized = event
    session.send("complete")
    terminated = session.next_event("terminated")  # every workload fact came before finalized
    session.send("acknowledge-terminated")
    os.kill(session.attach.pid, signal.SIGCONT)
    report.update(terminated=terminated, finalized=finalized,
                  attach_exit=session.attach.wait(timeout=60),
                  client_exit=session.client.wait(timeout=60), events=session.events)
    return None


def write_report(report):
    directory = os.environ.get("REPLOY_OUTPUT_DIR")
    if directory:
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(report, f, indent=2)


SCENARIOS = {
    "full": full, "terminate": terminate, "hold": hold, "hold-then-exit": hold_then_exit, "hold-terminating": hold_terminating,
    "stall": stall, "holder-loss": holder_loss, "no-attach": no_attach, "die": die, "close-stream": close_stream,
    "no-complete": no_complete, "no-ack": no_ack, "linger": linger,
    "output-file": output_file, "serve": serve, "isolation": isolation,
    "no-network": no_network,
    "audit": audit, "hostile": hostile, "stall-output": stall_output, "exit-code": exit_code,
    "rogue-handover": rogue_handover, "hold-before-broker": hold_before_broker,
    "prompt-loop": prompt_loop, "orphan-loop": orphan_loop,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--attach", choices=("pipe", "pty"), default="pipe")
    parser.add_argument("--variant", default="regular",
                        help="output-file: what to leave there; rogue-handover: what to hand; "
                             "prompt-loop, orphan-loop: how many rounds")
    args = parser.parse_args()
    report = {"scenario": args.scenario, "attach": args.attach, "variant": args.variant,
              "checks": {}, "error": None}
    code = 1
    with SessionDriver(attach=args.attach, timeout_s=30) as session:
        try:
            outcome = SCENARIOS[args.scenario](session, report)
            if outcome is not None:
                report.update(events=outcome.events, terminated=outcome.terminated,
                              client_exit=outcome.client_exit, attach_exit=outcome.attach_exit,
                              transcript=outcome.transcript.decode(errors="replace"))
            code = 0
        except Exception:  # the report must say what went wrong, whatever it was
            report["error"] = traceback.format_exc()
            report["events"] = session.events
            report["transcript_tail"] = session.transcript[-2000:].decode(errors="replace")
    write_report(report)
    print(json.dumps(report["checks"]), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
