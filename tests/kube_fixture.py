"""The real Kubernetes cluster of scripts/kube-cluster.sh, for tests marked `kubernetes`.

The session fixture runs `up` once (which reuses a running cluster, as in CI where .ci/run
brought it up) and yields the cluster with a fresh namespace of the run's own; the namespace
is deleted at the end, and the cluster brought down again only if this fixture started it.
Without a cluster to be had the tests skip, unless REPLOY_REQUIRE_KUBERNETES=1 (CI): then it
is a failure. Tests reach the API with stdlib urllib and the kubeconfig's CA and client
certificate (no kubectl).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest
import yaml

from agent_fixtures import harness

ROOT = Path(__file__).resolve().parent.parent
KUBE_SCRIPT = ROOT / "scripts" / "kube-cluster.sh"
REQUIRE_KUBERNETES_ENV = "REPLOY_REQUIRE_KUBERNETES"
#: A cold `up` builds Kubernetes first (10 to 14 minutes on 2 cores); a warm one about 30 s.
UP_TIMEOUT_S = 3600.0
VERB_TIMEOUT_S = 300.0
#: How often a wait asks the apiserver again.
APISERVER_POLL_S = 0.5


@dataclass(frozen=True)
class KubeApi:
    """Requests to the apiserver as the kubeconfig's user (CA-verified TLS, client certificate)."""

    server: str
    context: ssl.SSLContext

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        config = yaml.safe_load(path.read_text())
        current = config["current-context"]
        context = next(c["context"] for c in config["contexts"] if c["name"] == current)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        tls = ssl.create_default_context(cafile=cluster["certificate-authority"])
        tls.load_cert_chain(user["client-certificate"], user["client-key"])
        return cls(cluster["server"], tls)

    def request(self, method: str, path: str, body: dict | None = None,
                timeout_s: float = 30.0) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=timeout_s) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def json(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, Any]]:
        status, raw = self.request(method, path, body)
        return status, json.loads(raw) if raw.startswith(b"{") else {}


@dataclass(frozen=True)
class KubeCluster:
    kubeconfig: Path
    namespace: str
    nodes: tuple[str, ...]
    server: str
    api: KubeApi


def kube_script(*args: str, timeout_s: float = VERB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(KUBE_SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout_s)


def wait_until(what: str, condition: Callable[[], Any], timeout_s: float) -> Any:
    """agent_fixtures.harness.wait_until at the apiserver's pace (a poll every APISERVER_POLL_S)."""
    return harness.wait_until(condition, what, timeout_s, APISERVER_POLL_S)


def no_cluster(reason: str) -> NoReturn:
    if os.environ.get(REQUIRE_KUBERNETES_ENV) == "1":
        pytest.fail(f"{REQUIRE_KUBERNETES_ENV}=1 but no cluster: {reason}")
    pytest.skip(f"no Kubernetes cluster: {reason}")


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    try:
        started = kube_script("up", timeout_s=UP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        no_cluster(f"scripts/kube-cluster.sh up: {e}")
    if started.returncode != 0:
        no_cluster(f"scripts/kube-cluster.sh up exited {started.returncode}: {started.stderr[-2000:]}")
    line = json.loads(started.stdout.strip().splitlines()[-1])
    kubeconfig = Path(line["kubeconfig"])
    cluster = KubeCluster(kubeconfig, line["namespace"], tuple(line["nodes"]), line["server"],
                          KubeApi.from_kubeconfig(kubeconfig))
    try:
        yield cluster
    finally:
        cluster.api.request("DELETE", f"/api/v1/namespaces/{cluster.namespace}")
        if line["started"]:
            kube_script("down")
