#!/usr/bin/env python3
"""kube_cluster.py: a real two-node Kubernetes 1.20 cluster on this machine, for scripts/kube-cluster.sh.

No registry or Kubernetes download is reachable here, only Debian's archive, so everything is
built from Debian: the Kubernetes 1.20.2 tree in the orig tarball of Debian 12's `kubernetes`
source package, compiled with Go 1.15 from Debian 11 (1.20's vendored reflect2 breaks at run
time with Go >= 1.18), and etcd from Debian 12's etcd-server. The binaries are cached outside
the repository and built only when missing. The cluster runs on loopback only and leaves the
machine's default Docker engine, its sysctls and its hostname as they were (docs/kubernetes.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# ---------------------------------------------------------------------------------------------
# What is built, and where it is cached
# ---------------------------------------------------------------------------------------------

KUBE_VERSION = "1.20.2"
#: Debian 12's source package whose orig tarball is the full 1.20.2 tree (with vendor/); whichever
#: revision bookworm carries (1.20.5+really1.20.2-1.1+deb12u1 when written), checked to be 1.20.2.
KUBE_SOURCE_PACKAGE = "kubernetes"
GO_PACKAGES = ("golang-1.15-go", "golang-1.15-src")
ETCD_PACKAGES = ("etcd-server", "etcd-client")
ETCD_COMMANDS = ("etcdctl", "etcd")
KUBE_COMMANDS = ("kube-apiserver", "kubelet", "kube-scheduler", "kube-controller-manager")
#: Debian packages the build and the cluster need on the machine itself: command -> package.
HOST_PACKAGES = {"rsync": "rsync", "make": "make", "gcc": "gcc", "patch": "patch", "openssl": "openssl",
                 "nsenter": "util-linux", "unshare": "util-linux", "ip": "iproute2", "dockerd": "docker.io"}
SCRIPTS = Path(__file__).resolve().parent


def log(message: str) -> None:
    print(f"kube-cluster: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """The cache outside the repository: REPLOY_CACHE_DIR, else XDG_CACHE_HOME/reploy."""
    base = os.environ.get("REPLOY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "reploy")
    return Path(base) / f"kubernetes-{KUBE_VERSION}"


def bin_dir() -> Path:
    return cache_root() / "bin"


def install_binary(source: Path, name: str) -> None:
    """Into the cache's bin dir under a temporary name first: a killed build leaves no half file."""
    temporary = bin_dir() / f".{name}.partial"
    shutil.copy2(source, temporary)
    temporary.rename(bin_dir() / name)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A command whose failure ends the script; its output goes to stderr, never stdout."""
    kwargs.setdefault("stdout", sys.stderr)
    return subprocess.run(argv, check=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# Fetching from Debian's archive (a private apt configuration; the machine's is never edited)
# ---------------------------------------------------------------------------------------------

def ensure_host_packages() -> None:
    """Installs what is missing with the machine's apt (its lists refreshed if that fails first)."""
    missing = sorted({package for command, package in HOST_PACKAGES.items() if shutil.which(command) is None})
    if not missing:
        return
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, stdout=sys.stderr).returncode != 0:
        run(["apt-get", "update", "-q"], env=env)
        run(install, env=env)


def private_apt() -> dict[str, str]:
    """An environment whose APT_CONFIG has its own sources list, state and cache.

    Its sources are the machine's own Debian mirror (scripts/debian_mirror.py) for bookworm's
    sources and binaries and bullseye's binaries (Go 1.15)."""
    mirror = os.environ.get("REPLOY_DEBIAN_MIRROR") or subprocess.run(
        [sys.executable, str(SCRIPTS / "debian_mirror.py")], check=True, capture_output=True,
        text=True).stdout.strip()
    root = cache_root() / "apt"
    for sub in ("state/lists/partial", "cache/archives/partial", "parts", "preferences.d"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "state/status").touch()
    keyring = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]"
    (root / "sources.list").write_text(
        f"deb-src {keyring} {mirror} bookworm main\n"
        f"deb {keyring} {mirror} bookworm main\n"
        f"deb {keyring} {mirror} bullseye main\n")
    (root / "apt.conf").write_text(
        f'Dir::State "{root}/state";\n'
        f'Dir::State::status "{root}/state/status";\n'
        f'Dir::Cache "{root}/cache";\n'
        f'Dir::Etc::SourceList "{root}/sources.list";\n'
        f'Dir::Etc::SourceParts "{root}/parts";\n'
        f'Dir::Etc::Preferences "{root}/preferences";\n'
        f'Dir::Etc::PreferencesParts "{root}/preferences.d";\n'
        'APT::Sandbox::User "root";\n')
    env = {**os.environ, "APT_CONFIG": str(root / "apt.conf"), "DEBIAN_FRONTEND": "noninteractive"}
    if not any((root / "state/lists").glob("*Sources*")):
        log("apt-get update (private configuration)")
        run(["apt-get", "update", "-q"], env=env)
    return env


def unpack_debs(env: dict[str, str], packages: tuple[str, ...], into: Path) -> None:
    """`apt-get download` then `dpkg -x`: the files, nothing installed."""
    with tempfile.TemporaryDirectory(dir=cache_root()) as downloads:
        run(["apt-get", "download", "-q", *packages], env=env, cwd=downloads)
        staging = Path(downloads) / "root"
        for deb in sorted(Path(downloads).glob("*.deb")):
            run(["dpkg", "-x", str(deb), str(staging)])
        if into.exists():
            shutil.rmtree(into)
        staging.rename(into)


# ---------------------------------------------------------------------------------------------
# Building (each piece only when missing)
# ---------------------------------------------------------------------------------------------

def build_etcd(env: dict[str, str]) -> None:
    if all((bin_dir() / name).is_file() for name in ETCD_COMMANDS):
        return
    log("fetching etcd from Debian 12 (etcd-server, etcd-client)")
    unpacked = cache_root() / "etcd"
    unpack_debs(env, ETCD_PACKAGES, unpacked)
    for name in ETCD_COMMANDS:
        install_binary(unpacked / "usr/bin" / name, name)
    shutil.rmtree(unpacked)


def kube_tree(env: dict[str, str]) -> Path:
    """The unpacked 1.20.2 tree with Debian's patches applied (kept until the build ends)."""
    tree = cache_root() / f"src/kubernetes-{KUBE_VERSION}"
    if (tree / ".reploy-unpacked").is_file():
        return tree
    source = cache_root() / "src"
    if source.exists():
        shutil.rmtree(source)
    source.mkdir(parents=True)
    log(f"fetching Debian 12's {KUBE_SOURCE_PACKAGE} source package")
    run(["apt-get", "source", "--download-only", "-q", KUBE_SOURCE_PACKAGE], env=env, cwd=source)
    orig = next(source.glob("kubernetes_*.orig.tar.*"))
    run(["tar", "-xf", str(orig), "-C", str(source)])
    if not tree.is_dir():
        raise RuntimeError(f"{orig.name} holds no kubernetes-{KUBE_VERSION} tree")
    debian = next(source.glob("kubernetes_*.debian.tar.*"))
    run(["tar", "-xf", str(debian), "-C", str(tree)])
    series = tree / "debian/patches/series"
    for patch in series.read_text().split() if series.is_file() else ():
        run(["patch", "-p1", "-s", "-i", str(tree / "debian/patches" / patch)], cwd=tree)
    (tree / ".reploy-unpacked").touch()
    return tree


def go_root(env: dict[str, str]) -> Path:
    unpacked = cache_root() / "go1.15"
    goroot = unpacked / "usr/lib/go-1.15"
    if not (goroot / "bin/go").is_file():
        log("fetching Go 1.15 from Debian 11 (golang-1.15-go, golang-1.15-src)")
        unpack_debs(env, GO_PACKAGES, unpacked)
    return goroot


def build_kube(env: dict[str, str]) -> None:
    missing = [name for name in KUBE_COMMANDS if not (bin_dir() / name).is_file()]
    if not missing and (bin_dir() / "pause").is_file():
        return
    tree = kube_tree(env)
    if missing:
        goroot = go_root(env)
        log(f"building {' '.join(missing)} with Go 1.15 (10 to 14 minutes on 2 cores)")
        build_env = {**os.environ, "GOROOT": str(goroot), "PATH": f"{goroot}/bin:{os.environ['PATH']}",
                     "GOPROXY": "off", "GOFLAGS": "-mod=vendor", "GO111MODULE": "on",
                     "GOCACHE": str(cache_root() / "gocache"), "GOPATH": str(cache_root() / "gopath"),
                     "KUBE_GIT_VERSION": f"v{KUBE_VERSION}", "KUBE_GIT_TREE_STATE": "clean"}
        run(["make", "WHAT=" + " ".join(f"cmd/{name}" for name in missing)], cwd=tree, env=build_env)
        built = tree / "_output/local/bin/linux/amd64"
        for name in missing:
            install_binary(built / name, name)
    if not (bin_dir() / "pause").is_file():
        log("compiling the pause container's binary statically")
        run(["gcc", "-Os", "-static", "-Wall", f'-DVERSION=v{KUBE_VERSION}-reploy', "-o",
             str(bin_dir() / ".pause.partial"), str(tree / "build/pause/linux/pause.c")])
        (bin_dir() / ".pause.partial").rename(bin_dir() / "pause")
    for leftover in ("src", "go1.15", "gocache", "gopath"):
        if (cache_root() / leftover).exists():
            shutil.rmtree(cache_root() / leftover)


def build() -> None:
    """Everything the cluster runs, into the cache; a warm cache does nothing here."""
    bin_dir().mkdir(parents=True, exist_ok=True)
    if all((bin_dir() / name).is_file() for name in (*KUBE_COMMANDS, "pause", *ETCD_COMMANDS)):
        return
    env = private_apt()
    build_etcd(env)
    build_kube(env)


# ---------------------------------------------------------------------------------------------
# The cluster's shape: names, ports, flags (one place for each)
# ---------------------------------------------------------------------------------------------

NODE_NAMES = ("reploy-node-1", "reploy-node-2")
ETCD_NAMES = ("etcd-1", "etcd-2", "etcd-3")
LOOPBACK = "127.0.0.1"
APISERVER_PORT = 16443
#: etcd member i listens for clients on i2379 and for peers on i2380 (i = 1, 2, 3).
ETCD_CLIENT_PORT_FMT = "{}2379"
ETCD_PEER_PORT_FMT = "{}2380"
#: Node i's kubelet serves on KUBELET_PORT_BASE + i, in its namespace and (forwarded) on the host.
KUBELET_PORT_BASE = 11250
#: Node i's address on a bridge of its own (no ports; the kubelet refuses a loopback node IP).
NODE_IP_FMT = "10.250.0.{}"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_FIRST_IP = "10.96.0.1"
PAUSE_IMAGE = f"reploy-kube/pause:{KUBE_VERSION}"
#: The sysctls the kubelet insists on (setupKernelTunables); each node sees these values through
#: files bind-mounted in its own mount namespace, the host's stay as they are.
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
                   "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
                   "kernel/keys/root_maxbytes": "25000000"}
#: The kubelet's device-plugin directory is fixed under this path whatever --root-dir says, so each
#: node gets its own directory mounted here (in its mount namespace; the host keeps an empty one).
KUBELET_FIXED_ROOT = Path("/var/lib/kubelet")
#: Host-side mount points the nodes need; made if absent and removed again by `down`.
HOST_MOUNT_POINTS = (KUBELET_FIXED_ROOT, Path("/var/log/pods"), Path("/var/log/containers"))
NODE_MONITOR_GRACE = "20s"
APISERVER_READY_TIMEOUT_S = 180.0
NODES_READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 15.0
NAMESPACE_PREFIX = "reploy-"


def run_dir() -> Path:
    return cache_root() / "run"


def state_path() -> Path:
    return run_dir() / "state.json"


def server_url() -> str:
    return f"https://{LOOPBACK}:{APISERVER_PORT}"


def etcd_client_url(index: int) -> str:
    return f"https://{LOOPBACK}:{ETCD_CLIENT_PORT_FMT.format(index)}"


def etcd_peer_url(index: int) -> str:
    return f"https://{LOOPBACK}:{ETCD_PEER_PORT_FMT.format(index)}"


def node_dir(node: str) -> Path:
    return run_dir() / "nodes" / node


def node_index(node: str) -> int:
    return NODE_NAMES.index(node) + 1


def kubelet_port(node: str) -> int:
    return KUBELET_PORT_BASE + node_index(node)


# ---------------------------------------------------------------------------------------------
# Certificates and kubeconfigs (openssl; a CA for Kubernetes, another for etcd)
# ---------------------------------------------------------------------------------------------

def pki() -> Path:
    return run_dir() / "pki"


def openssl(*args: str) -> None:
    run(["openssl", *args], stderr=subprocess.DEVNULL)


def make_ca(name: str) -> None:
    openssl("req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", str(pki() / f"{name}.key"), "-out", str(pki() / f"{name}.crt"), "-days", "3650",
            "-subj", f"/CN=reploy-kube-{name}")


def make_cert(ca: str, name: str, subject: str, alt_names: tuple[str, ...] = ()) -> None:
    """A key and a certificate signed by `ca`, good for both TLS ends (serving and client)."""
    key, csr, crt = (str(pki() / f"{name}.{ext}") for ext in ("key", "csr", "crt"))
    openssl("req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", key, "-out", csr, "-subj", subject)
    extensions = pki() / f"{name}.ext"
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
             "extendedKeyUsage=serverAuth,clientAuth"]
    if alt_names:
        lines.append("subjectAltName=" + ",".join(alt_names))
    extensions.write_text("\n".join(lines) + "\n")
    openssl("x509", "-req", "-in", csr, "-CA", str(pki() / f"{ca}.crt"), "-CAkey", str(pki() / f"{ca}.key"),
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "3650",
            "-extfile", str(extensions), "-out", crt)
    os.unlink(csr)
    extensions.unlink()


def write_kubeconfig(path: Path, user: str, server: str) -> None:
    """A kubeconfig (JSON, which every kubeconfig reader takes) with a client certificate."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "reploy-kube", "preferences": {},
        "clusters": [{"name": "reploy-kube", "cluster": {
            "server": server, "certificate-authority": str(pki() / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki() / f"{user}.crt"),
                                          "client-key": str(pki() / f"{user}.key")}}],
        "contexts": [{"name": "reploy-kube", "context": {"cluster": "reploy-kube", "user": user}}]}
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def make_pki() -> None:
    pki().mkdir(mode=0o700, parents=True)
    make_ca("ca")
    make_ca("etcd-ca")
    make_cert("etcd-ca", "etcd", "/CN=reploy-kube-etcd", (f"IP:{LOOPBACK}", "DNS:localhost"))
    make_cert("etcd-ca", "apiserver-etcd-client", "/CN=kube-apiserver-etcd-client")
    make_cert("ca", "apiserver", "/CN=kube-apiserver",
              (f"IP:{LOOPBACK}", f"IP:{SERVICE_FIRST_IP}", "DNS:localhost", "DNS:kubernetes",
               "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
               "DNS:kubernetes.default.svc.cluster.local"))
    make_cert("ca", "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
    make_cert("ca", "admin", "/O=system:masters/CN=reploy-admin")
    make_cert("ca", "scheduler", "/CN=system:kube-scheduler")
    make_cert("ca", "controller-manager", "/CN=system:kube-controller-manager")
    for index, node in enumerate(NODE_NAMES, 1):
        make_cert("ca", node, f"/O=system:nodes/CN=system:node:{node}")
        make_cert("ca", f"{node}-serving", f"/CN={node}",
                  (f"DNS:{node}", f"IP:{LOOPBACK}", f"IP:{NODE_IP_FMT.format(index)}"))
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(pki() / "service-account.key"))
    openssl("pkey", "-in", str(pki() / "service-account.key"), "-pubout",
            "-out", str(pki() / "service-account.pub"))
    for user in ("admin", "scheduler", "controller-manager", *NODE_NAMES):
        write_kubeconfig(pki() / f"{user}.kubeconfig", user, server_url())
    for path in pki().iterdir():
        path.chmod(0o600)


# ---------------------------------------------------------------------------------------------
# Processes: spawned detached, recorded with their start time (a reused pid is not ours)
# ---------------------------------------------------------------------------------------------

def proc_stat(pid: int | str) -> Optional[list[str]]:
    """/proc/PID/stat's fields after the command name (state first), or None without that process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks, or None when no live process has this pid."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def alive(record: Optional[dict]) -> bool:
    if not record:
        return False
    return start_time(record["pid"]) == record["start"]


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        fields = proc_stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def spawn(argv: list[str], log_name: str) -> dict:
    """A detached process (own session, so `up` returns); output appended to a log in the run dir."""
    logs = run_dir() / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / f"{log_name}.log", "ab") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   start_new_session=True, close_fds=True)
    started = start_time(process.pid)
    if started is None:
        raise RuntimeError(f"{log_name} exited at once; see {logs / log_name}.log")
    return {"pid": process.pid, "start": started, "argv": argv, "log": str(logs / f"{log_name}.log")}


def stop(record: Optional[dict], sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Signals the record's process group (a process and what it started), SIGKILL after timeout_s."""
    if not alive(record):
        return
    assert record is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(record["pid"], sig)
    deadline = time.monotonic() + timeout_s
    while alive(record) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(record):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record["pid"], signal.SIGKILL)
        while alive(record):
            time.sleep(0.1)


def load_state() -> dict:
    try:
        return json.loads(state_path().read_text())
    except FileNotFoundError:
        return {}


def save_state(state: dict) -> None:
    temporary = state_path().with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.rename(state_path())


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT is no owner
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s (logs under {run_dir() / 'logs'})")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# The API, over loopback with the admin certificate (stdlib only; no kubectl)
# ---------------------------------------------------------------------------------------------

def api(method: str, path: str, body: Optional[dict] = None, timeout_s: float = 10.0) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(pki() / "ca.crt"))
    context.load_cert_chain(str(pki() / "admin.crt"), str(pki() / "admin.key"))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server_url() + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=timeout_s) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw.strip().startswith(b"{") else {}
    except ValueError:
        return status, {}


def api_ready() -> bool:
    try:
        return api("GET", "/readyz")[0] == 200
    except (OSError, ssl.SSLError):
        return False


def ready_nodes() -> set[str]:
    try:
        status, nodes = api("GET", "/api/v1/nodes")
    except (OSError, ssl.SSLError):
        return set()
    if status != 200:
        return set()
    return {item["metadata"]["name"] for item in nodes.get("items", [])
            if any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in item.get("status", {}).get("conditions", []))}


def new_namespace() -> str:
    """A fresh namespace, returned once its default ServiceAccount exists (Pods need it)."""
    name = NAMESPACE_PREFIX + secrets.token_hex(4)
    status, answer = api("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": name}})
    if status != 201:
        raise RuntimeError(f"creating namespace {name}: {status} {answer.get('message', '')}")
    wait_for(f"namespace {name}'s default ServiceAccount",
             lambda: api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")[0] == 200, 60.0)
    return name


# ---------------------------------------------------------------------------------------------
# Inside a node: its namespaces' first process, the OCI runtime wrapper, the byte relay
# ---------------------------------------------------------------------------------------------

def inherited_mount_points(mountinfo: str) -> list[str]:
    """The mount points a new mount namespace copied from the host that hold the host's own
    storage busy: loop devices (serve's session disks) and overlays (the host engine's
    containers), deepest first. A private copy of such a mount keeps its device alive after the
    host unmounts it, so a session disk's loop device would never be let go. Pure."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        separator = fields.index("-")
        point, fstype, source = fields[4], fields[separator + 1], fields[separator + 2]
        if source.startswith("/dev/loop") or fstype == "overlay":
            points.append(point.encode().decode("unicode_escape"))  # mountinfo's \040 escapes
    return sorted(points, key=lambda point: point.count("/"), reverse=True)


def release_inherited_mounts() -> int:
    """In a namespace just made: detaches (lazily) what inherited_mount_points names."""
    for point in inherited_mount_points(Path("/proc/self/mountinfo").read_text()):
        subprocess.run(["umount", "-l", point], stderr=subprocess.DEVNULL, check=False)
    return 0


def node_init(node: str) -> int:
    """PID 1 of a node's PID namespace (also in its own network, mount and UTS namespaces).

    Lays out the node's private view (a /run of its own, the kubelet's fixed directories, the
    sysctl values the kubelet insists on, a hostname, loopback up and a bridge carrying the node
    IP), says so in a file, then reaps orphans until killed (its death ends the namespace)."""
    home = node_dir(node)
    try:
        release_inherited_mounts()
        run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=256m", "tmpfs", "/run"])
        for name, value in KUBELET_SYSCTLS.items():
            if (Path("/proc/sys") / name).read_text().strip() != value:
                stand_in = home / "sysctl" / name.replace("/", ".")
                stand_in.parent.mkdir(exist_ok=True)
                stand_in.write_text(value + "\n")
                run(["mount", "--bind", "-o", "ro", str(stand_in), str(Path("/proc/sys") / name)])
        for mount_point in HOST_MOUNT_POINTS:
            private = home / "mounts" / mount_point.name
            private.mkdir(parents=True, exist_ok=True)
            run(["mount", "--bind", str(private), str(mount_point)])
        socket.sethostname(node)
        run(["ip", "link", "set", "lo", "up"])
        run(["ip", "link", "add", "reploy0", "type", "bridge"])
        run(["ip", "addr", "add", f"{NODE_IP_FMT.format(node_index(node))}/32", "dev", "reploy0"])
        run(["ip", "link", "set", "reploy0", "up"])
    except (OSError, subprocess.CalledProcessError) as e:
        (home / "init.failed").write_text(f"{e}\n")
        return 1
    (home / "init.ready").write_text(f"{os.getpid()}\n")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        signal.sigtimedwait({signal.SIGCHLD}, 5)


def oci_runtime(args: list[str]) -> int:
    """runc, with a negative oom_score_adj clamped to 0 (the node dockerd's default runtime).

    This machine lacks CAP_SYS_RESOURCE, so the kubelet's -998 (pause) and -997 (Guaranteed
    Pods) make runc fail; without that capability a process goes no lower than it started (0)."""
    for flag, value in zip(args, args[1:]):
        if flag == "--bundle":  # create, run: the container's spec
            path, process_of = Path(value) / "config.json", lambda document: document.get("process", {})
        elif flag == "--process":  # exec: the extra process's own spec
            path, process_of = Path(value), lambda document: document
        else:
            continue
        document = json.loads(path.read_text())
        process = process_of(document)
        if process.get("oomScoreAdj", 0) < 0:
            process["oomScoreAdj"] = 0
            path.write_text(json.dumps(document))
    os.execvp("runc", ["runc", *args])
    return 127


def relay_endpoint(text: str) -> tuple[int, Any]:
    kind, _, where = text.partition(":")
    if kind == "tcp":
        return socket.AF_INET, (LOOPBACK, int(where))
    if kind == "unix":
        return socket.AF_UNIX, where
    raise ValueError(f"relay endpoint {text!r}: tcp:PORT or unix:PATH")


def relay_pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)
            source.shutdown(socket.SHUT_RDWR)


def relay_connection(client: socket.socket, target: tuple[int, Any]) -> None:
    with client, socket.socket(target[0], socket.SOCK_STREAM) as upstream:
        try:
            upstream.connect(target[1])
        except OSError:
            return
        back = threading.Thread(target=relay_pump, args=(upstream, client), daemon=True)
        back.start()
        relay_pump(client, upstream)
        back.join()


def relay(rules: list[str]) -> int:
    """Byte forwarders LISTEN>TARGET (tcp:PORT on loopback, or unix:PATH, made 0600).

    A node's loopback and the host's are different networks; a unix socket in the run directory
    is the one thing both see, so each direction is a TCP listener on one side relaying to a
    unix socket listened on by the relay on the other side."""
    os.umask(0o077)
    listeners = []
    for rule in rules:
        listen, target = (relay_endpoint(part) for part in rule.split(">", 1))
        server = socket.socket(listen[0], socket.SOCK_STREAM)
        if listen[0] == socket.AF_UNIX:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(listen[1])
        else:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(listen[1])
        server.listen(64)
        listeners.append((server, target))

    def serve(server: socket.socket, target: tuple[int, Any]) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # out of descriptors, say: this connection is lost, not the relay
                time.sleep(0.1)
                continue
            threading.Thread(target=relay_connection, args=(client, target), daemon=True).start()

    threads = [threading.Thread(target=serve, args=pair, daemon=True) for pair in listeners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


# ---------------------------------------------------------------------------------------------
# Starting the parts
# ---------------------------------------------------------------------------------------------

def etcd_argv(index: int, token: str) -> list[str]:
    name = ETCD_NAMES[index - 1]
    members = ",".join(f"{member}={etcd_peer_url(i)}" for i, member in enumerate(ETCD_NAMES, 1))
    return [str(bin_dir() / "etcd"), f"--name={name}", f"--data-dir={run_dir() / name}",
            f"--listen-client-urls={etcd_client_url(index)}", f"--advertise-client-urls={etcd_client_url(index)}",
            f"--listen-peer-urls={etcd_peer_url(index)}", f"--initial-advertise-peer-urls={etcd_peer_url(index)}",
            f"--initial-cluster={members}", "--initial-cluster-state=new", f"--initial-cluster-token={token}",
            f"--cert-file={pki() / 'etcd.crt'}", f"--key-file={pki() / 'etcd.key'}", "--client-cert-auth",
            f"--trusted-ca-file={pki() / 'etcd-ca.crt'}", f"--peer-cert-file={pki() / 'etcd.crt'}",
            f"--peer-key-file={pki() / 'etcd.key'}", "--peer-client-cert-auth",
            f"--peer-trusted-ca-file={pki() / 'etcd-ca.crt'}", "--logger=zap", "--log-outputs=stderr"]


def apiserver_argv() -> list[str]:
    """The apiserver, in a mount namespace of its own whose /etc/hosts maps each node's name to
    loopback, where the host side of the relays serves each kubelet's port."""
    hosts = run_dir() / "apiserver-hosts"
    hosts.write_text(f"{LOOPBACK} localhost\n" + "".join(f"{LOOPBACK} {node}\n" for node in NODE_NAMES))
    issuer = "https://kubernetes.default.svc.cluster.local"
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'{sys.executable} {Path(__file__).resolve()} release-mounts && '
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
            str(bin_dir() / "kube-apiserver"), f"--bind-address={LOOPBACK}", f"--secure-port={APISERVER_PORT}",
            "--insecure-port=0", "--endpoint-reconciler-type=none",
            "--etcd-servers=" + ",".join(etcd_client_url(i) for i in range(1, len(ETCD_NAMES) + 1)),
            f"--etcd-cafile={pki() / 'etcd-ca.crt'}", f"--etcd-certfile={pki() / 'apiserver-etcd-client.crt'}",
            f"--etcd-keyfile={pki() / 'apiserver-etcd-client.key'}",
            f"--client-ca-file={pki() / 'ca.crt'}", f"--tls-cert-file={pki() / 'apiserver.crt'}",
            f"--tls-private-key-file={pki() / 'apiserver.key'}",
            f"--kubelet-client-certificate={pki() / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki() / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki() / 'ca.crt'}", "--kubelet-preferred-address-types=Hostname",
            f"--service-account-key-file={pki() / 'service-account.pub'}",
            f"--service-account-signing-key-file={pki() / 'service-account.key'}",
            f"--service-account-issuer={issuer}", f"--api-audiences={issuer}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction", "--anonymous-auth=false", "--profiling=false",
            "--allow-privileged=false"]


def scheduler_argv() -> list[str]:
    return [str(bin_dir() / "kube-scheduler"), f"--kubeconfig={pki() / 'scheduler.kubeconfig'}",
            "--leader-elect=true", f"--bind-address={LOOPBACK}", "--port=0", "--secure-port=0"]


def controller_manager_argv() -> list[str]:
    return [str(bin_dir() / "kube-controller-manager"),
            f"--kubeconfig={pki() / 'controller-manager.kubeconfig'}", "--leader-elect=true",
            f"--bind-address={LOOPBACK}", "--port=0", "--secure-port=0",
            f"--service-account-private-key-file={pki() / 'service-account.key'}",
            f"--root-ca-file={pki() / 'ca.crt'}", "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki() / 'ca.crt'}", f"--cluster-signing-key-file={pki() / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allocate-node-cidrs=false",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE}", "--node-monitor-period=2s"]


def host_relay_argv() -> list[str]:
    rules = []
    for node in NODE_NAMES:
        rules.append(f"tcp:{kubelet_port(node)}>unix:{node_dir(node) / 'kubelet.sock'}")
        rules.append(f"unix:{node_dir(node) / 'api.sock'}>tcp:{APISERVER_PORT}")
    return [sys.executable, str(Path(__file__).resolve()), "relay", *rules]


def in_node(state: dict, node: str, argv: list[str]) -> list[str]:
    """argv run inside the node's namespaces (the PID one included: nsenter forks into it)."""
    target = state["nodes"][node]["init_pid"]
    return ["nsenter", f"--target={target}", "--net", "--mount", "--uts", "--pid", "--", *argv]


def docker_socket(node: str) -> Path:
    return node_dir(node) / "docker.sock"


def node_docker(node: str, *args: str) -> list[str]:
    return ["docker", "-H", f"unix://{docker_socket(node)}", *args]


def dockerd_argv(node: str) -> list[str]:
    """The node's own dockerd: its data, exec root, pidfile and socket, in the node's namespaces.
    (The exec root and pidfile are in the node's private /run; dockershim finds its dockerd by
    the pidfile there and by name in the node's PID namespace, never the machine's engine.)"""
    return ["dockerd", f"--host=unix://{docker_socket(node)}", f"--data-root={node_dir(node) / 'docker'}",
            "--exec-root=/run/docker", "--pidfile=/run/docker.pid", "--storage-driver=overlay2",
            "--log-driver=json-file", "--exec-opt=native.cgroupdriver=cgroupfs", "--oom-score-adjust=0",
            f"--add-runtime=reploy-runc={run_dir() / 'oci-runtime'}", "--default-runtime=reploy-runc"]


def cgroup_root(node: str) -> str:
    return f"/reploy-kube-{node}"


def cgroup_hierarchies() -> list[Path]:
    """The mount points of this machine's cgroup hierarchies (v1 ones, and v2 where mounted)."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] in ("cgroup", "cgroup2"):
            found.append(Path(fields[1]))
    return found


def kubelet_argv(node: str) -> list[str]:
    home = node_dir(node)
    return [str(bin_dir() / "kubelet"), f"--kubeconfig={pki() / (node + '.kubeconfig')}",
            f"--hostname-override={node}", f"--node-ip={NODE_IP_FMT.format(node_index(node))}",
            "--container-runtime=docker", f"--docker-endpoint=unix://{docker_socket(node)}",
            f"--pod-infra-container-image={PAUSE_IMAGE}", f"--root-dir={KUBELET_FIXED_ROOT}",
            f"--experimental-dockershim-root-directory={home / 'dockershim'}",
            f"--volume-plugin-dir={home / 'volume-plugins'}",
            f"--tls-cert-file={pki() / (node + '-serving.crt')}",
            f"--tls-private-key-file={pki() / (node + '-serving.key')}",
            f"--client-ca-file={pki() / 'ca.crt'}", "--anonymous-auth=false", "--authorization-mode=Webhook",
            f"--address={LOOPBACK}", f"--port={kubelet_port(node)}", "--read-only-port=0",
            f"--healthz-bind-address={LOOPBACK}", "--cgroup-driver=cgroupfs",
            f"--cgroup-root={cgroup_root(node)}", "--cgroups-per-qos=true",
            "--protect-kernel-defaults=true", "--oom-score-adj=0", "--fail-swap-on=false",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
            "--eviction-hard=memory.available<100Mi,nodefs.available<2%,imagefs.available<2%",
            "--hairpin-mode=none", "--node-status-update-frequency=4s", "--pod-max-pids=1024",
            "--cluster-domain=cluster.local"]


def node_relay_argv(node: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "relay",
            f"tcp:{APISERVER_PORT}>unix:{node_dir(node) / 'api.sock'}",
            f"unix:{node_dir(node) / 'kubelet.sock'}>tcp:{kubelet_port(node)}"]


def pause_image_tar() -> Path:
    """The pause image's one file, as a tarball for `docker import` (no registry exists here)."""
    path = run_dir() / "pause.tar"
    if not path.is_file():
        with tarfile.open(path, "w") as tar:
            info = tar.gettarinfo(str(bin_dir() / "pause"), arcname="pause")
            info.mode, info.uid, info.gid, info.uname, info.gname = 0o755, 0, 0, "root", "root"
            with open(bin_dir() / "pause", "rb") as binary:
                tar.addfile(info, binary)
    return path


def docker_answers(node: str) -> bool:
    return subprocess.run(node_docker(node, "version", "--format", "{{.Server.Version}}"),
                          capture_output=True).returncode == 0


def start_node(state: dict, node: str) -> None:
    """The node's namespaces, its dockerd (with the pause image) and its relay; the kubelet after."""
    home = node_dir(node)
    home.mkdir(parents=True)
    for hierarchy in cgroup_hierarchies():
        (hierarchy / cgroup_root(node).lstrip("/")).mkdir(exist_ok=True)
    record: dict[str, Any] = {}
    state["nodes"][node] = record
    record["init"] = spawn(["unshare", "--fork", "--pid", "--mount-proc", "--net", "--mount", "--uts",
                            "--propagation", "private", "--", sys.executable, str(Path(__file__).resolve()),
                            "node-init", node, str(run_dir())], f"{node}-init")
    save_state(state)
    wait_for(f"{node}'s namespaces", lambda: (home / "init.ready").is_file() or (home / "init.failed").is_file(),
             30.0)
    if (home / "init.failed").is_file():
        raise RuntimeError(f"{node}'s namespaces: {(home / 'init.failed').read_text().strip()}")
    inits = children(record["init"]["pid"])
    if len(inits) != 1:
        raise RuntimeError(f"{node}: expected one first process under unshare, found {inits}")
    record["init_pid"] = inits[0]
    record["dockerd"] = spawn(in_node(state, node, dockerd_argv(node)), f"{node}-dockerd")
    record["relay"] = spawn(in_node(state, node, node_relay_argv(node)), f"{node}-relay")
    save_state(state)


def finish_node(state: dict, node: str) -> None:
    wait_for(f"{node}'s dockerd", lambda: docker_answers(node), 60.0)
    run(node_docker(node, "import", "--change", 'ENTRYPOINT ["/pause"]', str(pause_image_tar()), PAUSE_IMAGE),
        stdout=subprocess.DEVNULL)
    state["nodes"][node]["kubelet"] = spawn(in_node(state, node, kubelet_argv(node)), f"{node}-kubelet")
    save_state(state)


# ---------------------------------------------------------------------------------------------
# The verbs
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One verb at a time changes the cluster (a second `up` waits, then reuses the first's)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


#: How long `up` gives a live apiserver to answer ready before it takes the cluster for dead:
#: /readyz fails for moments on a busy machine or while an etcd member restarts, and one failed
#: probe must never tear down a cluster that others are using.
REUSE_READY_WAIT_S = 60.0


def running(state: dict) -> bool:
    """Whether the cluster of `state` runs: its apiserver is alive and answers ready."""
    if not alive(state.get("processes", {}).get("kube-apiserver")):
        return False
    try:
        wait_for("the running apiserver", api_ready, REUSE_READY_WAIT_S)
    except RuntimeError:
        return False
    return True


def announce(state: dict, started: bool) -> None:
    """The one JSON line on stdout: what a caller needs to use the cluster, with a namespace of its own."""
    print(json.dumps({"kubeconfig": str(pki() / "admin.kubeconfig"), "namespace": new_namespace(),
                      "nodes": list(NODE_NAMES), "server": server_url(), "started": started}), flush=True)


def up() -> int:
    with locked():
        ensure_host_packages()
        build()
        state = load_state()
        if state and running(state):
            log("reusing the running cluster")
            # An `up` interrupted after the apiserver came up leaves nodes still on their way.
            wait_for("both nodes Ready", lambda: ready_nodes() >= set(NODE_NAMES), NODES_READY_TIMEOUT_S)
            announce(state, started=False)
            return 0
        teardown()
        started_at = time.monotonic()
        busy = [port for port in (APISERVER_PORT, *(kubelet_port(node) for node in NODE_NAMES),
                                  *(int(ETCD_CLIENT_PORT_FMT.format(i)) for i in range(1, 4)),
                                  *(int(ETCD_PEER_PORT_FMT.format(i)) for i in range(1, 4)))
                if not port_free(port)]
        if busy:
            log(f"loopback ports {busy} are taken by something else; not starting")
            return 1
        try:
            start_cluster()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            log(f"up failed: {e}")
            keep = cache_root() / "failed-logs"
            shutil.rmtree(keep, ignore_errors=True)
            if (run_dir() / "logs").is_dir():
                shutil.copytree(run_dir() / "logs", keep)
                log(f"its logs are kept in {keep}")
            teardown()
            return 1
        shutil.rmtree(cache_root() / "failed-logs", ignore_errors=True)  # an earlier failure's, now stale
        log(f"cluster up in {time.monotonic() - started_at:.0f} s")
        announce(load_state(), started=True)
    return 0


def start_cluster() -> None:
    run_dir().mkdir(mode=0o700, parents=True)
    made = [str(path) for path in HOST_MOUNT_POINTS if not path.exists()]
    state: dict[str, Any] = {"processes": {}, "nodes": {}, "made_dirs": made}
    save_state(state)
    for path in made:
        Path(path).mkdir(parents=True)
    log("certificates")
    make_pki()
    oci = run_dir() / "oci-runtime"
    oci.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} oci-runtime "$@"\n')
    oci.chmod(0o755)
    processes = state["processes"]
    token = secrets.token_hex(8)
    log("etcd (3 members)")
    for index, name in enumerate(ETCD_NAMES, 1):
        processes[name] = spawn(etcd_argv(index, token), name)
        save_state(state)
    log("kube-apiserver")
    processes["kube-apiserver"] = spawn(apiserver_argv(), "kube-apiserver")
    save_state(state)
    log("the nodes' namespaces and dockerds")
    for node in NODE_NAMES:
        start_node(state, node)
    processes["host-relay"] = spawn(host_relay_argv(), "host-relay")
    save_state(state)
    wait_for("kube-apiserver", api_ready, APISERVER_READY_TIMEOUT_S)
    log("kube-scheduler, kube-controller-manager")
    processes["kube-scheduler"] = spawn(scheduler_argv(), "kube-scheduler")
    processes["kube-controller-manager"] = spawn(controller_manager_argv(), "kube-controller-manager")
    save_state(state)
    log("the kubelets")
    for node in NODE_NAMES:
        finish_node(state, node)
    wait_for("both nodes Ready", lambda: ready_nodes() >= set(NODE_NAMES), NODES_READY_TIMEOUT_S)


def our_processes() -> list[int]:
    """Processes whose command line names the run directory: what an interrupted `up` may have
    left without a record (every part the script starts names it)."""
    marker = str(run_dir()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def remove_cgroup(path: Path) -> None:
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def teardown() -> None:
    """Everything `up` started or made, gone; the machine's own engine, sysctls and hostname untouched.
    (Killed outright: the state goes too, so nothing is gained by a graceful stop.)"""
    state = load_state()
    for node, record in state.get("nodes", {}).items():
        stop(record.get("kubelet"), signal.SIGKILL)
        if record.get("init_pid") and alive(record.get("init")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record["init_pid"], signal.SIGKILL)  # ends the node's PID namespace
        for part in ("init", "dockerd", "relay"):
            stop(record.get(part), signal.SIGKILL)
    processes = state.get("processes", {})
    for name in ("kube-controller-manager", "kube-scheduler", "host-relay", "kube-apiserver", *ETCD_NAMES):
        stop(processes.get(name), signal.SIGKILL)
    for pid in our_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while our_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    for node in NODE_NAMES:
        for hierarchy in cgroup_hierarchies():
            remove_cgroup(hierarchy / cgroup_root(node).lstrip("/"))
    for path in reversed(state.get("made_dirs", [])):
        with contextlib.suppress(OSError):
            Path(path).rmdir()
    if run_dir().exists():
        shutil.rmtree(run_dir())


def down() -> int:
    with locked():
        teardown()
    log("down: nothing of the cluster runs")
    return 0


def start_or_stop(verb: str, target: str) -> int:
    with locked():
        state = load_state()
        if not state:
            log("no cluster is up")
            return 1
        if target in ETCD_NAMES:
            key, holder = target, state["processes"]
        elif target in NODE_NAMES:
            key, holder = "kubelet", state["nodes"][target]
        else:
            log(f"unknown target {target!r}: one of {', '.join((*NODE_NAMES, *ETCD_NAMES))}")
            return 2
        record = holder[key]
        if verb == "stop":
            # A node's kubelet dies as in a crash; its dockerd and Pods stay. An etcd member stops with its data kept.
            stop(record, signal.SIGKILL if target in NODE_NAMES else signal.SIGTERM)
        elif not alive(record):
            holder[key] = spawn(record["argv"], target if target in ETCD_NAMES else f"{target}-kubelet")
            save_state(state)
        log(f"{verb} {target}: done")
    return 0


def etcd_healthy(index: int) -> bool:
    """The member's own /health (as the apiserver's etcd client): it serves and has a leader."""
    context = ssl.create_default_context(cafile=str(pki() / "etcd-ca.crt"))
    context.load_cert_chain(str(pki() / "apiserver-etcd-client.crt"), str(pki() / "apiserver-etcd-client.key"))
    try:
        with urllib.request.urlopen(etcd_client_url(index) + "/health", context=context, timeout=3) as answer:
            return json.loads(answer.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def status() -> int:
    state = load_state()
    processes = state.get("processes", {})
    up_now = bool(state) and running(state)
    print(json.dumps({
        "running": up_now, "server": server_url(),
        "kubeconfig": str(pki() / "admin.kubeconfig") if state else None,
        "control_plane": {name: alive(processes.get(name))
                          for name in ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "host-relay")},
        "etcd": {name: {"running": alive(processes.get(name)),
                        "healthy": alive(processes.get(name)) and etcd_healthy(index)}
                 for index, name in enumerate(ETCD_NAMES, 1)},
        "nodes": {node: {part: alive(record.get(part)) for part in ("init", "dockerd", "relay", "kubelet")}
                  for node, record in state.get("nodes", {}).items()},
        "ready_nodes": sorted(ready_nodes()) if up_now else []}))
    return 0


def image_id(argv: list[str]) -> Optional[str]:
    found = subprocess.run(argv, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def load(images: list[str]) -> int:
    """Images from the machine's engine into every node's dockerd (no registry; Pods use
    imagePullPolicy: Never). A node that has the same image id already is skipped."""
    state = load_state()
    if not state:
        log("no cluster is up")
        return 1
    for image in images:
        wanted = image_id(["docker", "image", "inspect", "--format", "{{.Id}}", image])
        if wanted is None:
            log(f"{image}: not in the machine's Docker engine")
            return 1
        needing = [node for node in NODE_NAMES
                   if image_id(node_docker(node, "image", "inspect", "--format", "{{.Id}}", image)) != wanted]
        if not needing:
            continue
        with tempfile.NamedTemporaryFile(dir=run_dir(), suffix=".tar") as archive:
            run(["docker", "save", "--output", archive.name, image])
            for node in needing:
                log(f"loading {image} into {node}")
                run(node_docker(node, "load", "--input", archive.name), stdout=subprocess.DEVNULL)
    return 0


USAGE = """usage: kube-cluster.sh VERB
  up                   build what is missing, start the cluster (or reuse the running one);
                       prints one JSON line: kubeconfig, namespace (fresh), nodes, server
  load IMAGE...        copy images from the machine's Docker engine into every node
  stop|start TARGET    TARGET: a node's name (its kubelet) or etcd-1, etcd-2, etcd-3
  status               JSON of what runs
  down                 stop and remove everything up started
  build                only build the binaries into the cache"""


def main(argv: list[str]) -> int:
    try:
        return dispatch(argv)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        log(str(e))
        return 1


def dispatch(argv: list[str]) -> int:
    verb, args = (argv[0], argv[1:]) if argv else ("", [])
    if verb == "up" and not args:
        return up()
    if verb == "down" and not args:
        return down()
    if verb in ("stop", "start") and len(args) == 1:
        return start_or_stop(verb, args[0])
    if verb == "status" and not args:
        return status()
    if verb == "load" and args:
        return load(args)
    if verb == "build" and not args:
        ensure_host_packages()
        build()
        return 0
    if verb == "release-mounts" and not args:
        return release_inherited_mounts()
    if verb == "node-init" and len(args) == 2:
        return node_init(args[0])
    if verb == "relay" and args:
        return relay(args)
    if verb == "oci-runtime":
        return oci_runtime(args)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
