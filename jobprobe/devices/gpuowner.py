# SPDX-License-Identifier: Apache-2.0
"""Which GPUs a set of processes may use, by what the kernel and their environment say: the GPUs (and MIG devices)
their CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES name (in /proc/PID/environ: indices within what the process can
see, GPU- and MIG-UUIDs or unique prefixes, as CUDA reads them), and the GPU minors (/dev/nvidiaN, major 195) their
device cgroup allows: the v1 devices.list, or on cgroup v2 the group's device programs, read back and run
(jobprobe/kernel/devcg.py). The caller names the processes (pids) and the GPUs NVML sees (devices/nvml.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jobprobe.kernel import procfs
from jobprobe.kernel.host import find_cgroup_v1_mount

if TYPE_CHECKING:
    from jobprobe.devices.nvmltypes import Gpu
    from jobprobe.kernel.devcg import DeviceRules

ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
NVIDIA_MAJOR = "195"
NOT_GPU_MINORS = 254     # 195:254 is nvidia-modeset, 195:255 nvidiactl; GPUs are 195:0…253


# ---- rule env: CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES ----------------------------------------------------
def read_visible_env(proc: str, pid: int) -> dict[str, str]:
    return procfs.environ(proc, pid, ENV_KEYS) or {}


def parse_visible(value: str, gpus: list[Gpu], base: list[Gpu]) -> set[int]:
    """GPU indices a *_VISIBLE_DEVICES value names. Integers count within `base` (the GPUs the process can see);
    GPU-UUIDs (or a unique prefix, as CUDA accepts) name a GPU outright. Like CUDA, an entry that names nothing
    ends the list. MIG devices are visible_migs()' business."""
    v = value.strip()
    if v.lower() in ("", "none", "void", "nodevfiles"):
        return set()
    if v.lower() == "all":
        return {g.index for g in base}
    out: set[int] = set()
    for item in (s.strip() for s in v.split(",")):
        if item.startswith("MIG-"):
            continue
        if item.isdigit() and int(item) < len(base):
            out.add(base[int(item)].index)
            continue
        hits = [g for g in gpus if item.startswith("GPU-") and g.uuid and g.uuid.startswith(item)]
        if len(hits) != 1:
            break
        out.add(hits[0].index)
    return out


def visible_migs(value: str, gpus: list[Gpu]) -> set[tuple[int, int]]:
    """(GPU index, slot) of the MIG devices a *_VISIBLE_DEVICES value names: `MIG-<uuid>` (or a unique prefix), or
    the older `MIG-GPU-<gpu uuid>/<gpu instance>/<compute instance>`."""
    migs = [m for g in gpus for m in g.migs]
    out: set[tuple[int, int]] = set()
    for item in (s.strip() for s in value.split(",")):
        if item.startswith("MIG-GPU-") and item.count("/") == 2:
            uuid, gi, ci = item[len("MIG-"):].split("/")
            hits = [m for m in migs if m.parent.uuid == uuid and str(m.gi) == gi and str(m.ci) == ci]
        elif item.startswith("MIG-"):
            hits = [m for m in migs if m.uuid and m.uuid.startswith(item)]
        else:
            continue
        if len(hits) == 1:
            out.add((hits[0].index, hits[0].slot))
    return out


# ---- rule devices: the v1 device cgroup (SLURM ConstrainDevices, container runtimes on v1 hosts) ---------------
def v1_mount(mountinfo: str, controller: str = "devices") -> tuple[str, str] | None:
    """(mount point, root) of the v1 hierarchy that carries `controller`, from mountinfo; None if none."""
    return find_cgroup_v1_mount(mountinfo, controller)


def cgroup_v1_path(proc: str, pid: int, controller: str = "devices") -> str | None:
    return procfs.cgroup_v1_path(proc, pid, controller)


def allowed_gpu_minors(devices_list: str) -> set[int] | None:
    """GPU minors a devices.list allows; None when it does not restrict GPUs (`a *:* rwm`, `c 195:* …`)."""
    minors: set[int] = set()
    for line in devices_list.splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue
        kind, devno, _ = parts
        major, _, minor = devno.partition(":")
        if kind == "a" or (kind == "c" and major in (NVIDIA_MAJOR, "*") and minor == "*"):
            return None
        if kind == "c" and major == NVIDIA_MAJOR and minor.isdigit() and int(minor) < NOT_GPU_MINORS:
            minors.add(int(minor))
    return minors


# ---- both rules, for a set of processes -------------------------------------------------------------------
def cgroup_and_env(gpus: list[Gpu], pids: set[int], proc: str, mountinfo: str, cgroup2: str | None,
                   devcg: DeviceRules) -> tuple[set[int], set[int], set[tuple[int, int]]]:
    """GPU indices the processes' device cgroups allow, those their *_VISIBLE_DEVICES name, and the MIG devices
    ((GPU index, slot)) they name.
    Integer indices count within what the process can see: the GPUs NVIDIA_VISIBLE_DEVICES names (a
    container), else those its device cgroup allows, else all in NVML order (CUDA_DEVICE_ORDER=PCI_BUS_ID;
    UUIDs are exact either way)."""
    mount = v1_mount(mountinfo)
    gpu_minors = {g.minor for g in gpus if g.minor is not None and 0 <= g.minor < NOT_GPU_MINORS}
    lists: dict[str, set[int] | None] = {}    # devices.list read once per cgroup per tick
    devices: set[int] = set()
    env: set[int] = set()
    env_migs: set[tuple[int, int]] = set()
    for pid in sorted(pids):
        allowed = None
        path = cgroup_v1_path(proc, pid) if mount else None
        if path is not None and (path + "/").startswith(mount[1].rstrip("/") + "/"):
            full = str(Path(mount[0], path[len(mount[1].rstrip("/")):].lstrip("/"), "devices.list"))
            if full not in lists:
                try:
                    lists[full] = allowed_gpu_minors(Path(full).read_text())
                except OSError:
                    lists[full] = None
            minors = lists[full]
            if minors is not None:
                allowed = {g.index for g in gpus if g.minor in minors}
                devices |= allowed
        if allowed is None and cgroup2 and (path := procfs.cgroup2_path(proc, pid)) is not None:
            full = str(Path(cgroup2, path.lstrip("/")))
            if full not in lists:
                lists[full] = devcg.allowed_minors(full, int(NVIDIA_MAJOR), gpu_minors)
            minors = lists[full]
            if minors is not None:
                allowed = {g.index for g in gpus if g.minor in minors}
                devices |= allowed
        vis = read_visible_env(proc, pid)
        for value in vis.values():
            env_migs |= visible_migs(value, gpus)
        base = gpus if allowed is None else [g for g in gpus if g.index in allowed]
        if "NVIDIA_VISIBLE_DEVICES" in vis:
            named = parse_visible(vis["NVIDIA_VISIBLE_DEVICES"], gpus, base)
            base = [g for g in base if g.index in named]
            if "CUDA_VISIBLE_DEVICES" not in vis:
                env |= named
        if "CUDA_VISIBLE_DEVICES" in vis:
            env |= parse_visible(vis["CUDA_VISIBLE_DEVICES"], gpus, base)
    return devices, env, env_migs
