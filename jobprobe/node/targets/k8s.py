# SPDX-License-Identifier: Apache-2.0
"""Kubernetes pods: `k8s_pod_target()`, the pod's cgroup2 group by its UID (`k8s_pod_cgroup()` finds it under
either kubelet cgroup driver, wherever the kubelet's root sits).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from jobprobe.core.errors import BadInput
from jobprobe.kernel.host import find_cgroup2_mount
from jobprobe.node.targets.cgroup import CgroupTarget

POD_UID = re.compile(r"[0-9a-f]{8}([-_][0-9a-f]{4}){3}[-_][0-9a-f]{12}")


def k8s_pod_cgroup(uid: str, mount: str, max_depth: int = 8) -> str | None:
    """Where the kubelet put pod `uid`'s group, wherever its root is (kubepods, kubelet.slice/..., a node in a
    container): `pod<uid>` with the cgroupfs driver (kubepods/[burstable|besteffort/]pod<uid>), or
    `kubepods[-burstable|-besteffort]-pod<uid, '_' for '-'>.slice` with the systemd driver. Containers are groups
    below it; the pod's group holds them all."""
    dashed = uid.lower().replace("_", "-")
    names = {f"pod{dashed}", f"pod{dashed.replace('-', '_')}"}

    def is_pod(d: str) -> bool:
        return d in names or (d.endswith(".slice") and d[:-len(".slice")].rsplit("-", 1)[-1] in names)

    base = len(Path(mount).parts)
    for root, subdirs, _ in os.walk(mount):
        hit = next((d for d in subdirs if is_pod(d)), None)
        if hit:
            return str(Path(root, hit))
        # not into other pods' trees (their containers), nor deeper than a kubelet root can sit
        depth = len(Path(root).parts) - base
        subdirs[:] = [] if depth >= max_depth else \
            [d for d in subdirs if not (d.startswith("pod") or "-pod" in d)]
    return None


def k8s_pod_target(uid: str, mountinfo: str = "/proc/self/mountinfo", job: str | None = None) -> CgroupTarget:
    if not POD_UID.fullmatch(uid.lower()):
        raise BadInput(f"not a pod UID: {uid!r} (8-4-4-4-12 hex digits, as "
                       f"`kubectl get pod NAME -o jsonpath='{{.metadata.uid}}'` prints it)")
    mount = find_cgroup2_mount(mountinfo)
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted: pods are found by their cgroup2 group")
    path = k8s_pod_cgroup(uid, mount)
    if path is None:
        raise BadInput(f"pod {uid} has no cgroup2 group on this node (not scheduled here, or already gone)")
    return CgroupTarget(path, mountinfo=mountinfo, job=job or f"pod-{uid.lower().replace('_', '-')}")
