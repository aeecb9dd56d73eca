"""scripts/kube-cluster.sh: the real two-node cluster it starts (nodes, hardened Pods, failures).

Everything goes through the apiserver with stdlib urllib (tests/kube_fixture.py). The failure
tests stop a part with the script's own verb and wait, bounded, for the API to say so; they
start it again whatever happens.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from functools import partial

import pytest

from kube_fixture import KubeCluster, kube_script, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.kubernetes]

BUSYBOX = "reploy-base/busybox:1"
POD_RUNNING_TIMEOUT_S = 120.0
#: The controller-manager's node-monitor grace period is 20 s; a node's status then follows.
NODE_CONDITION_TIMEOUT_S = 120.0
ETCD_MEMBER_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def busybox(kube_cluster: KubeCluster) -> str:
    loaded = kube_script("load", BUSYBOX)
    assert loaded.returncode == 0, loaded.stderr
    return BUSYBOX


def pod_manifest(name: str, command: str, node: str | None = None) -> dict:
    """A Pod hardened as the project's sessions will be: non-root, read-only root, no
    capabilities, no privilege escalation, the runtime's seccomp profile, no API token."""
    spec: dict = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": {"runAsUser": 1000, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "main", "image": BUSYBOX, "imagePullPolicy": "Never",
            "command": ["sh", "-c", command],
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
        }],
    }
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def pods(kube_cluster: KubeCluster, busybox: str) -> Iterator[list[str]]:
    """Names of the Pods a test creates; deleted after it."""
    names: list[str] = []
    yield names
    for name in names:
        kube_cluster.api.request(
            "DELETE", f"/api/v1/namespaces/{kube_cluster.namespace}/pods/{name}?gracePeriodSeconds=0")


def create_pod(cluster: KubeCluster, pods: list[str], command: str, node: str | None = None) -> str:
    name = f"t-{secrets.token_hex(4)}"
    status, answer = cluster.api.json("POST", f"/api/v1/namespaces/{cluster.namespace}/pods",
                                      pod_manifest(name, command, node))
    assert status == 201, answer
    pods.append(name)
    return name


def pod(cluster: KubeCluster, name: str) -> dict:
    status, answer = cluster.api.json("GET", f"/api/v1/namespaces/{cluster.namespace}/pods/{name}")
    assert status == 200, answer
    return answer


def in_phase(cluster: KubeCluster, name: str, phase: str) -> bool:
    return pod(cluster, name)["status"].get("phase") == phase


def pod_log(cluster: KubeCluster, name: str) -> str:
    status, raw = cluster.api.request("GET", f"/api/v1/namespaces/{cluster.namespace}/pods/{name}/log")
    return raw.decode() if status == 200 else ""


def node_ready(cluster: KubeCluster, node: str) -> bool:
    status, answer = cluster.api.json("GET", f"/api/v1/nodes/{node}")
    assert status == 200, answer
    return any(c["type"] == "Ready" and c["status"] == "True" for c in answer["status"]["conditions"])


def cluster_status() -> dict:
    answer = kube_script("status")
    assert answer.returncode == 0, answer.stderr
    return json.loads(answer.stdout)


# ---------------------------------------------------------------------------------------------
# Nodes and Pods
# ---------------------------------------------------------------------------------------------

def test_both_nodes_are_ready(kube_cluster: KubeCluster) -> None:
    status, nodes = kube_cluster.api.json("GET", "/api/v1/nodes")
    assert status == 200, nodes
    assert {item["metadata"]["name"] for item in nodes["items"]} == set(kube_cluster.nodes)
    assert len(kube_cluster.nodes) == 2
    for node in kube_cluster.nodes:
        assert node_ready(kube_cluster, node), node


def test_a_hardened_pod_runs_without_new_privileges_under_seccomp(
        kube_cluster: KubeCluster, pods: list[str]) -> None:
    name = create_pod(kube_cluster, pods, "cat /proc/self/status; exec sleep 600")
    wait_until(f"Pod {name} Running", partial(in_phase, kube_cluster, name, "Running"), POD_RUNNING_TIMEOUT_S)
    status_lines = wait_until(f"Pod {name}'s log", lambda: "Seccomp:" in pod_log(kube_cluster, name)
                              and pod_log(kube_cluster, name).splitlines(), POD_RUNNING_TIMEOUT_S)
    assert "NoNewPrivs:\t1" in status_lines
    assert "Seccomp:\t2" in status_lines
    assert "Uid:\t1000\t1000\t1000\t1000" in status_lines
    assert "CapEff:\t0000000000000000" in status_lines


def test_a_pod_pinned_to_each_node_runs_there(kube_cluster: KubeCluster, pods: list[str]) -> None:
    placed = {node: create_pod(kube_cluster, pods, f"echo ran-on-{node}", node) for node in kube_cluster.nodes}
    for node, name in placed.items():
        wait_until(f"Pod {name} on {node} Succeeded", partial(in_phase, kube_cluster, name, "Succeeded"),
                   POD_RUNNING_TIMEOUT_S)
        assert pod(kube_cluster, name)["spec"]["nodeName"] == node
        assert pod_log(kube_cluster, name) == f"ran-on-{node}\n"


# ---------------------------------------------------------------------------------------------
# Failures: an etcd member, a node's kubelet
# ---------------------------------------------------------------------------------------------

def test_the_api_stays_writable_with_one_etcd_member_stopped(kube_cluster: KubeCluster) -> None:
    configmaps = f"/api/v1/namespaces/{kube_cluster.namespace}/configmaps"
    stopped = kube_script("stop", "etcd-1")
    try:
        assert stopped.returncode == 0, stopped.stderr
        assert cluster_status()["etcd"]["etcd-1"] == {"running": False, "healthy": False}
        status, answer = kube_cluster.api.json("POST", configmaps, {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "written-without-etcd-1"},
            "data": {"written": "yes"}})
        assert status == 201, answer
        status, answer = kube_cluster.api.json("GET", f"{configmaps}/written-without-etcd-1")
        assert (status, answer["data"]) == (200, {"written": "yes"})
    finally:
        started = kube_script("start", "etcd-1")
        kube_cluster.api.request("DELETE", f"{configmaps}/written-without-etcd-1")
    assert started.returncode == 0, started.stderr
    wait_until("etcd-1 healthy again",
               lambda: cluster_status()["etcd"]["etcd-1"] == {"running": True, "healthy": True},
               ETCD_MEMBER_TIMEOUT_S)


def test_a_stopped_kubelet_makes_its_node_not_ready_until_started(kube_cluster: KubeCluster) -> None:
    node = kube_cluster.nodes[-1]
    stopped = kube_script("stop", node)
    try:
        assert stopped.returncode == 0, stopped.stderr
        assert cluster_status()["nodes"][node]["kubelet"] is False
        wait_until(f"{node} NotReady", lambda: not node_ready(kube_cluster, node), NODE_CONDITION_TIMEOUT_S)
    finally:
        started = kube_script("start", node)
    assert started.returncode == 0, started.stderr
    wait_until(f"{node} Ready again", lambda: node_ready(kube_cluster, node), NODE_CONDITION_TIMEOUT_S)
