# SPDX-License-Identifier: Apache-2.0
"""`jobprobe doctor`: is this node ready for training jobs, and for jobprobe? One line per check — pass, warn, fail
or absent (what the check looks at is not on this node: no GPU, no RDMA device) — with the fix for each that is
not a pass.

Checks: root; BPF usable (a two-instruction program loaded, as the probes will); kernel BTF or headers (bcc
compiles against them); a hardware PMU (perf's hardware counters); cgroup v2 and its controllers; PSI; NVML and
the driver version; persistence mode and accounting mode (exited processes' GPU use) per GPU; GPUDirect RDMA
(nvidia_peermem) where GPUs and RDMA devices meet;
each GPU's nearest RDMA NIC (PCIe switch / host bridge / NUMA node, as `nvidia-smi topo -m` says it); ACS on the
PCIe bridges between a GPU and its NIC (redirected peer-to-peer traffic: GPUDirect through the root complex);
RDMA links up; RoCE ECN / PFC / DSCP trust where the driver exposes them in sysfs; MTU and rate alike across
rails; the clock synchronised (adjtimex), since traces across nodes share a start time.

Every file read goes through the host's roots (Host.sys, Host.proc, `root` for /lib/modules, /usr/src): tests
run the doctor on fixture trees of broken nodes. Exit code: 0 when the worst is pass or absent, 1 warn, 3 fail
(2 is bad input, as for every command).
"""
from __future__ import annotations

import ctypes as ct
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Callable

from jobprobe.core.libc import LIBC
from jobprobe.devices import pci, rdma
from jobprobe.kernel.host import Host

ORDER = {"pass": 0, "absent": 0, "warn": 1, "fail": 3}
WANT_CONTROLLERS = ("cpu", "memory", "io", "pids")
MIN_DRIVER = 525                     # CUDA 12's minimum driver branch


@dataclass
class Check:
    name: str
    status: str                      # pass | warn | fail | absent
    detail: str
    fix: str = ""


@dataclass
class Ctx:
    host: Host
    root: str = ""                   # prefix for /lib/modules, /usr/src (fixtures)
    nvml: Any = None                 # jobprobe.devices.nvml.Nvml, or the reason there is none
    adjtimex: Callable[[], tuple[int, int, int]] | None = None   # (status, maxerror µs, esterror µs)

    def read(self, path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None


class NvmlView:
    """What the doctor asks of NVML (the real binding, pynvml)."""

    def __init__(self, nv: Any):
        self.nv = nv
        nv.nvmlInit()

    def driver_version(self) -> str:
        v = self.nv.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def gpus(self) -> list[int]:
        return list(range(self.nv.nvmlDeviceGetCount()))

    def persistence_mode(self, i: int) -> bool:
        return self.nv.nvmlDeviceGetPersistenceMode(self.nv.nvmlDeviceGetHandleByIndex(i)) == 1

    def accounting_mode(self, i: int) -> bool:
        return self.nv.nvmlDeviceGetAccountingMode(self.nv.nvmlDeviceGetHandleByIndex(i)) == 1


def open_nvml() -> NvmlView | str:
    """NVML, or why there is none."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        return NvmlView(pynvml)
    except pynvml.NVMLError as err:
        from jobprobe.devices.nvmltypes import INIT_ERRORS
        return INIT_ERRORS.get(err.value, f"nvmlInit failed: {err}")


# ---- each check -----------------------------------------------------------------------------------------------
def check_root(c: Ctx) -> Check:
    if os.geteuid() == 0:
        return Check("root", "pass", "running as root")
    return Check("root", "fail", f"running as uid {os.geteuid()}: the probes need root (BPF, perf, other users' /proc)",
                 "run the agent as root (its systemd unit does)")


def check_bpf(c: Ctx) -> Check:
    from jobprobe.kernel import bpf as _bpf
    # BPF_PROG_LOAD of `r0 = 0; exit` as a socket filter: what any program load needs, nothing attached
    insns = (ct.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)
    lic = ct.create_string_buffer(b"GPL")

    class Attr(ct.Structure):
        _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                    ("license", ct.c_uint64)]
    try:
        fd = _bpf.sys_bpf(5, Attr(1, 2, ct.addressof(insns), ct.addressof(lic)))      # BPF_PROG_LOAD
    except OSError as err:
        why = {1: "not permitted (not root, or kernel.unprivileged_bpf_disabled / a lockdown)",
               38: "the kernel has no bpf(2) (CONFIG_BPF_SYSCALL)"}.get(err.errno, os.strerror(err.errno))
        return Check("bpf", "fail", f"a BPF program cannot be loaded: {why}",
                     "run as root on a kernel with CONFIG_BPF_SYSCALL=y (and no lockdown=confidentiality)")
    os.close(fd)
    return Check("bpf", "pass", "a BPF program loads")


def check_btf_headers(c: Ctx) -> Check:
    release = platform.release()
    btf = os.path.exists(f"{c.host.sys}/kernel/btf/vmlinux")
    heads = [p for p in (f"{c.root}/lib/modules/{release}/build", f"{c.root}/usr/src/linux-headers-{release}")
             if os.path.isdir(p)]
    if heads:
        return Check("btf_or_headers", "pass", f"kernel headers at {heads[0]}" + ("; BTF too" if btf else ""))
    if btf:
        return Check("btf_or_headers", "warn", "kernel BTF, no headers for this kernel: bcc needs headers to compile",
                     f"install the kernel headers for {release} (Debian: linux-headers-{release})")
    return Check("btf_or_headers", "fail", f"no kernel headers for {release} and no BTF: the eBPF probes cannot be "
                 "compiled", f"install linux-headers-{release}")


def check_pmu(c: Ctx) -> Check:
    base = f"{c.host.sys}/bus/event_source/devices"
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    pmus = [n for n in names if n in ("cpu", "cpu_core", "cpu_atom") or n.startswith("armv8_pmuv3")
            or n.startswith("armv9")]
    if pmus:
        return Check("pmu", "pass", f"hardware PMU: {', '.join(sorted(pmus))}")
    return Check("pmu", "warn", "no hardware PMU: perf counts software events only (cycles, instructions, cache "
                 "misses are absent)", "on a VM, enable the virtual PMU (e.g. KVM `-cpu host,pmu=on`)")


def check_cgroup(c: Ctx) -> Check:
    from jobprobe.kernel.host import find_cgroup2_mount
    mount = find_cgroup2_mount(f"{c.host.proc}/self/mountinfo")
    if mount is None:
        return Check("cgroup_v2", "fail", "no cgroup2 hierarchy mounted: cgroup targets and PSI are unavailable",
                     "boot with systemd.unified_cgroup_hierarchy=1 (or mount cgroup2)")
    have = set((c.read(f"{c.root}{mount}/cgroup.controllers") or "").split())
    missing = [k for k in WANT_CONTROLLERS if k not in have]
    hybrid = os.path.basename(mount) == "unified"
    if hybrid or missing:
        what = ("hybrid v1+v2 layout (cgroup2 at " + mount + ")" if hybrid else "") + \
            (("; " if hybrid else "") + f"controllers missing in cgroup2: {', '.join(missing)}" if missing else "")
        return Check("cgroup_v2", "warn", what + ": jobs in v1 groups are probed by their PIDs",
                     "boot with systemd.unified_cgroup_hierarchy=1 (SLURM: cgroup/v2 plugin)")
    return Check("cgroup_v2", "pass",
                 f"cgroup2 at {mount}, controllers {' '.join(sorted(have & set(WANT_CONTROLLERS)))}")


def check_psi(c: Ctx) -> Check:
    if os.path.exists(f"{c.host.proc}/pressure/cpu"):
        return Check("psi", "pass", "pressure stall information on")
    return Check("psi", "warn", "no /proc/pressure: the pressure probe is unavailable",
                 "a kernel with CONFIG_PSI=y, booted without psi=0 (psi=1 where it is off by default)")


def gpus(c: Ctx) -> list[pci.Function]:
    return [f for f in pci.devices(c.host.sys).values() if f.is_gpu]


def check_nvml(c: Ctx) -> Check:
    found = gpus(c)
    if not found:
        return Check("nvml", "absent", "no NVIDIA GPU on the PCI bus")
    if isinstance(c.nvml, str) or c.nvml is None:
        return Check("nvml", "fail", f"{len(found)} NVIDIA GPU(s) on the bus, NVML unusable: {c.nvml or 'not tried'}",
                     "install the NVIDIA driver (libnvidia-ml.so.1) matching the kernel module")
    version = c.nvml.driver_version()
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_DRIVER:
        return Check("nvml", "warn", f"driver {version}: older than {MIN_DRIVER} (CUDA 12)",
                     f"upgrade the NVIDIA driver to {MIN_DRIVER} or later")
    return Check("nvml", "pass", f"driver {version}, {len(c.nvml.gpus())} GPU(s)")


def check_persistence(c: Ctx) -> Check:
    if not gpus(c) or isinstance(c.nvml, str) or c.nvml is None:
        return Check("persistence", "absent", "no GPU reachable through NVML")
    off = [i for i in c.nvml.gpus() if not c.nvml.persistence_mode(i)]
    if off:
        return Check("persistence", "warn", f"persistence mode off on GPU {', '.join(map(str, off))}: each job pays "
                     "the driver's initialisation, and a GPU left idle loses its state", "run nvidia-persistenced")
    return Check("persistence", "pass", "persistence mode on for every GPU")


def check_accounting(c: Ctx) -> Check:
    if not gpus(c) or isinstance(c.nvml, str) or c.nvml is None:
        return Check("accounting", "absent", "no GPU reachable through NVML")
    try:
        off = [i for i in c.nvml.gpus() if not c.nvml.accounting_mode(i)]
    except Exception as err:              # a driver without accounting
        return Check("accounting", "absent", f"NVML accounting unavailable: {err}")
    if off:
        return Check("accounting", "warn", f"accounting mode off on GPU {', '.join(map(str, off))}: a job process "
                     "that exits between two ticks leaves no record of its GPU use", "nvidia-smi -am 1 (as root, "
                     "per boot; or in the node's GPU setup)")
    return Check("accounting", "pass", "accounting mode on for every GPU")


def check_gpudirect(c: Ctx) -> Check:
    if not gpus(c) or not rdma.devices(c.host.sys):
        return Check("gpudirect", "absent", "GPUDirect RDMA needs both GPUs and RDMA devices")
    if os.path.isdir(f"{c.host.sys}/module/nvidia_peermem") or \
            "nvidia_peermem" in (c.read(f"{c.host.proc}/modules") or ""):
        return Check("gpudirect", "pass", "nvidia_peermem loaded")
    return Check("gpudirect", "fail", "GPUs and RDMA devices, but nvidia_peermem is not loaded: NCCL stages every "
                 "transfer through host memory", "modprobe nvidia-peermem (and load it at boot)")


def nearest(c: Ctx) -> list[tuple[pci.Function, pci.Function | None, str]]:
    """Each GPU with its nearest RDMA device's PCI function and their relation."""
    devs = pci.devices(c.host.sys)
    nics = [devs[p.pci] for p in rdma.ports(c.host.sys) if p.pci in devs]
    rank = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
    out = []
    for g in (f for f in devs.values() if f.is_gpu):
        best = min(nics, key=lambda n: rank[pci.relation(g, n)], default=None)
        out.append((g, best, pci.relation(g, best) if best else "none"))
    return out


def check_affinity(c: Ctx) -> Check:
    pairs = nearest(c)
    if not pairs or all(n is None for _, n, _ in pairs):
        return Check("gpu_nic_affinity", "absent", "needs GPUs and RDMA devices")
    said = [f"GPU {g.address} ↔ {n.address if n else '-'}: {rel}" for g, n, rel in pairs]
    worst = max(pairs, key=lambda x: {"PIX": 0, "PXB": 0, "PHB": 1, "NODE": 1, "SYS": 2}.get(x[2], 2))[2]
    if worst in ("PIX", "PXB"):
        return Check("gpu_nic_affinity", "pass", "each GPU shares a PCIe switch with a NIC: " + "; ".join(said))
    if worst in ("PHB", "NODE"):
        return Check("gpu_nic_affinity", "warn", "a GPU reaches its nearest NIC through the host bridge: "
                     + "; ".join(said), "put GPU and NIC under one PCIe switch (or accept host-bridge P2P)")
    return Check("gpu_nic_affinity", "fail", "a GPU's nearest NIC is on another NUMA node (SYS): " + "; ".join(said),
                 "place a NIC on each GPU's NUMA node / PCIe switch; set NCCL_IB_HCA per GPU")


def check_acs(c: Ctx) -> Check:
    pairs = [(g, n) for g, n, rel in nearest(c) if n is not None and rel in ("PIX", "PXB")]
    if not pairs:
        return Check("acs", "absent", "no GPU shares a PCIe switch with a NIC")
    bad, unread = [], 0
    for g, n in pairs:
        for b in pci.between(g, n):
            ctl = pci.acs_control(c.host.sys, b)
            if ctl is None:
                unread += 1
            elif ctl & (pci.ACS_RR | pci.ACS_CR):
                bad.append(f"{b} (ACS control {ctl:#06x})")
    if bad:
        return Check("acs", "fail", "ACS redirects peer-to-peer traffic on bridges between GPU and NIC: "
                     + ", ".join(sorted(set(bad))), "disable ACS on those bridges (setpci -s BRIDGE ECAP_ACS+6.w=0) "
                     "or in the BIOS; keep it where VMs need isolation")
    return Check("acs", "pass", "no ACS redirect between GPU and NIC" + (f" ({unread} bridges without ACS)"
                                                                          if unread else ""))


def check_rdma_links(c: Ctx) -> Check:
    ports = rdma.ports(c.host.sys)
    if not ports:
        return Check("rdma_links", "absent", "no RDMA device")
    down = [f"{p.name} {p.state or '?'}/{p.phys_state or '?'}" for p in ports if p.state != "ACTIVE"]
    if down:
        return Check("rdma_links", "fail", f"RDMA ports not ACTIVE: {', '.join(down)}",
                     "check cables and the subnet manager (ibstat, opensm) / the switch port")
    return Check("rdma_links", "pass", f"{len(ports)} RDMA port(s) ACTIVE")


def check_roce_qos(c: Ctx) -> Check:
    roce = [p for p in rdma.ports(c.host.sys) if p.link_layer == "Ethernet" and p.netdev]
    if not roce:
        return Check("roce_qos", "absent", "no RoCE port")
    problems, seen = [], 0
    for p in roce:
        base = f"{c.host.sys}/class/net/{p.netdev}"
        np = [c.read(f"{base}/ecn/roce_np/enable/{i}") for i in range(8)]
        rp = [c.read(f"{base}/ecn/roce_rp/enable/{i}") for i in range(8)]
        if any(v is not None for v in np + rp):
            seen += 1
            if "1" not in np or "1" not in rp:
                problems.append(f"{p.netdev}: ECN (DCQCN) off on every priority "
                                f"({'notification' if '1' not in np else 'reaction'} point)")
        pfc = c.read(f"{base}/qos/pfc")
        if pfc is not None:
            seen += 1
            if not any(x.strip() == "1" for x in pfc.replace(",", " ").split()):
                problems.append(f"{p.netdev}: PFC off on every priority")
        trust = c.read(f"{base}/qos/trust")
        if trust is not None:
            seen += 1
            if trust.lower() != "dscp":
                problems.append(f"{p.netdev}: trust {trust} (DSCP expected for routed RoCE)")
    if problems:
        return Check("roce_qos", "warn", "; ".join(problems), "configure lossless RoCE: PFC on the RoCE priority, "
                     "ECN/DCQCN on it, trust DSCP (mlnx_qos / the NIC vendor's tool), to match the switches")
    if not seen:
        return Check("roce_qos", "absent", "the RoCE driver exposes no ECN/PFC/trust settings in sysfs")
    return Check("roce_qos", "pass", "ECN and PFC on for RoCE where readable")


def check_rails(c: Ctx) -> Check:
    ports = [p for p in rdma.ports(c.host.sys) if p.state == "ACTIVE"]
    if len(ports) < 2:
        return Check("rails", "absent", "fewer than two active RDMA ports")
    rates = {p.name: p.rate_gbps for p in ports}
    mtus = {p.name: c.read(f"{c.host.sys}/class/net/{p.netdev}/mtu") for p in ports if p.netdev}
    odd = []
    if len(set(rates.values())) > 1:
        odd.append("rates " + ", ".join(f"{k} {v:g} Gb/s" for k, v in sorted(rates.items())))
    if len(set(mtus.values())) > 1:
        odd.append("MTUs " + ", ".join(f"{k} {v}" for k, v in sorted(mtus.items())))
    if odd:
        return Check("rails", "warn", "rails differ: " + "; ".join(odd) + " — a collective runs at its slowest rail",
                     "retrain the slow link / set the same MTU on every rail")
    return Check("rails", "pass", f"{len(ports)} rails alike ({next(iter(rates.values())):g} Gb/s)")


class Timex(ct.Structure):
    _fields_ = [("modes", ct.c_uint), ("offset", ct.c_long), ("freq", ct.c_long), ("maxerror", ct.c_long),
                ("esterror", ct.c_long), ("status", ct.c_int), ("rest", ct.c_long * 20)]


def adjtimex() -> tuple[int, int, int]:
    tx = Timex()
    if LIBC.adjtimex(ct.byref(tx)) < 0:
        raise OSError(ct.get_errno(), "adjtimex")
    return tx.status, tx.maxerror, tx.esterror


def clock_verdict(status: int, maxerror_us: int, esterror_us: int) -> Check:
    if status & 0x40:                                           # STA_UNSYNC
        return Check("clock", "warn", "the kernel clock is not synchronised (STA_UNSYNC): traces opened on every "
                     "node at one time start apart, and frames' times disagree across nodes",
                     "run chrony or ntpd (or PTP) on every node")
    if maxerror_us > 100_000:
        return Check("clock", "warn", f"clock synchronised, but its maximum error is {maxerror_us / 1000:.0f} ms",
                     "check the time source (chronyc tracking)")
    return Check("clock", "pass", f"synchronised (estimated error {esterror_us} µs)")


def check_clock(c: Ctx) -> Check:
    try:
        return clock_verdict(*(c.adjtimex or adjtimex)())
    except OSError as err:
        return Check("clock", "warn", f"adjtimex: {err}", "")


CHECKS: list[Callable[[Ctx], Check]] = [check_root, check_bpf, check_btf_headers, check_pmu, check_cgroup, check_psi,
                                        check_nvml, check_persistence, check_accounting, check_gpudirect,
                                        check_affinity, check_acs,
                                        check_rdma_links, check_roce_qos, check_rails, check_clock]


def run(ctx: Ctx) -> list[Check]:
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(ctx))
        except Exception as err:           # a check's bug is said, not a crash of the whole list
            out.append(Check(fn.__name__.removeprefix("check_"), "warn", f"the check failed: {err}"))
    return out


def worst(checks: list[Check]) -> str:
    return max((c.status for c in checks), key=lambda s: ORDER[s], default="pass")


def exit_code(checks: list[Check]) -> int:
    return ORDER[worst(checks)]


def as_dict(checks: list[Check]) -> dict:
    return {"worst": worst(checks), "checks": [asdict(c) for c in checks]}


def text(checks: list[Check]) -> str:
    mark = {"pass": "pass  ", "warn": "WARN  ", "fail": "FAIL  ", "absent": "absent"}
    lines = []
    for c in checks:
        lines.append(f"{mark[c.status]} {c.name:<17} {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            lines.append(f"{'':24}fix: {c.fix}")
    lines.append(f"worst: {worst(checks)}")
    return "\n".join(lines)
