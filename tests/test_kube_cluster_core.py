"""scripts/kube_cluster.py's pure parts, without a cluster."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("kube_cluster", ROOT / "scripts" / "kube_cluster.py")
assert _spec is not None and _spec.loader is not None
kube_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kube_cluster)

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
36 27 7:0 / /tmp/rs-1/state/disks/abc rw,relatime shared:5 - ext4 /dev/loop0 rw
38 36 7:3 / /tmp/rs-1/state/disks/abc/sub\\040dir rw - ext4 /dev/loop3 rw
37 27 0:50 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw,lowerdir=a
40 27 0:52 / /run/user/0 rw - tmpfs tmpfs rw
"""


def test_a_new_namespace_lets_go_of_the_hosts_disks_and_overlays_deepest_first() -> None:
    """A node's private copy of a session disk's mount would keep its loop device attached
    after serve unmounts it on the host (a delete's `still attached`)."""
    assert kube_cluster.inherited_mount_points(MOUNTINFO) == [
        "/tmp/rs-1/state/disks/abc/sub dir", "/var/lib/docker/overlay2/x/merged", "/tmp/rs-1/state/disks/abc"]
