# SPDX-License-Identifier: Apache-2.0
"""gpu — the job's GPUs through NVML: which GPUs are the job's, and per GPU per tick utilization, memory (the job's
own too), clocks, power and energy, temperature, PCIe and NVLink traffic, clock-event (throttle) reasons, ECC and
remapped rows, GPM profiling metrics (Hopper+); XID errors and lost GPUs as event frames.

Which GPUs are the job's, decided again every tick (a job may open a GPU late), strongest rule first:
  process — one of the job's PIDs is on the GPU's compute, graphics or MPS process list (NVML);
  devices — a job process's device cgroup allows that GPU's /dev/nvidiaN (major 195) and not all GPUs: the v1
            devices.list, or on cgroup v2 the group's device programs (eBPF), read back and run
            (jobprobe/kernel/devcg.py);
  env     — CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES in a job process's /proc/PID/environ (indices or UUIDs).
On a GPU in MIG mode the same holds per MIG device (process: on that device's list; env: its MIG-UUID named), a GPU
is the job's when one of its MIG devices is, and `mig` lists those devices with their own memory and processes.
A GPU is `shared` when NVML lists processes on it that are not the job's.

Hooks: nvidia-ml-py (`pynvml`, the real binding; jobprobe/devices/nvml.py), /proc/PID/{environ,cgroup}, the v1 devices
hierarchy found in mountinfo, or bpf(2) PROG_QUERY on the job's cgroup2 groups. Needs: libnvidia-ml.so.1 (the
NVIDIA driver), root to read other users' environ and the device programs.
Cost: 2–3 process-list calls per GPU of the node, ~15 NVML calls per job GPU and two small reads per job process
per tick; no thread, no NVML background polling of our own.
"""
from __future__ import annotations

import ctypes
import importlib.util

from jobprobe.contract.probe import EVENTS_KEY, Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.devices.gpuowner import cgroup_and_env
from jobprobe.devices.nvml import Nvml
from jobprobe.devices.nvmltypes import INIT_ERRORS, LIBRARY, NO_DRIVER, Gpu, GpuLost, Mig  # noqa: F401
from jobprobe.kernel.devcg import DeviceRules
from jobprobe.kernel.host import Host


class GpuProbe(Probe):
    name = "gpu"
    default = True
    needs_root = False
    summary = "the job's GPUs (NVML): utilization, memory, clocks, power, energy, PCIe/NVLink, throttling, ECC, GPM"
    fields = {
        "gpus": Field("list[map]", "—", "one map per GPU of the job now (fields gpus[].*); empty: the job has none"),
        "ngpus": Field("int", "count", "GPUs of the job now (lost ones included)", kind="gauge"),
        "node_gpus": Field("int", "count", "GPUs NVML sees on this node", kind="gauge"),
        "note": Field("str", "—", "only when gpus is empty: why (the job uses no GPU, or the node has none)"),
        "unsupported": Field("list[str]", "—", "only in the tick they were found: `gpuN.metric` (that GPU) or "
                             "`metric` (the driver lacks it); never asked again"),
        "gpus[].index": Field("int", "—", "NVML index (PCI bus order)"),
        "gpus[].uuid": Field("str", "—", "GPU-UUID"),
        "gpus[].name": Field("str", "—", "product name"),
        "gpus[].rule": Field("str", "—", "why it is the job's: process | devices | env (the strongest that holds)"),
        "gpus[].lost": Field("bool", "—", "fell off the bus (NVML_ERROR_GPU_IS_LOST); no other values follow"),
        "gpus[].shared": Field("bool", "—", "NVML lists processes on it that are not the job's"),
        "gpus[].job_procs": Field("int", "count", "job processes on NVML's process lists"),
        "gpus[].other_procs": Field("int", "count", "other processes on NVML's process lists"),
        "gpus[].job_mem_bytes": Field("int", "bytes", "GPU memory of the job's processes (sum of usedGpuMemory)"),
        "gpus[].procs": Field("list[map]", "—", "the job's processes on it: {pid, mem_bytes (null: NVML can't tell)}"),
        "gpus[].sharing": Field("str", "—", "how the GPU is shared: exclusive (only the job's processes), "
                                "time-slicing (other jobs' processes have contexts on it), mps (an MPS server "
                                "runs it: other clients' work runs beside the job's), mig (split into MIG devices: "
                                "see mig)"),
        "gpus[].job_mem_share": Field("float", "ratio", "the job's GPU memory (job_mem_bytes) over the GPU's memory "
                                      "used (mem_used_bytes, every process and the driver's own)", kind="gauge"),
        "gpus[].job_sm_pct": Field("float", "%", "the job's own SM utilization this interval: each of its processes' "
                                   "per-process samples averaged, summed over its processes (NVML per-process "
                                   "utilization)", kind="gauge"),
        "gpus[].job_mem_util_pct": Field("float", "%", "the job's own memory-controller utilization, as job_sm_pct",
                                         kind="gauge"),
        "gpus[].job_enc_pct": Field("float", "%", "the job's own encoder utilization, as job_sm_pct", kind="gauge"),
        "gpus[].job_dec_pct": Field("float", "%", "the job's own decoder utilization, as job_sm_pct", kind="gauge"),
        "gpus[].others_sm_pct": Field("float", "%", "the SM utilization of every other process on the GPU, as "
                                      "job_sm_pct: job_sm_pct + others_sm_pct is the GPU's, as its processes' "
                                      "samples add up", kind="gauge"),
        "gpus[].util_samples": Field("int", "count", "per-process samples the driver took this interval (each read "
                                     "once: the newest time stamp seen is carried to the next tick)"),
        "gpus[].util_source": Field("str", "—", "the call that gave them: ProcessesUtilizationInfo (newer drivers) "
                                    "or ProcessUtilization"),
        "gpus[].job_energy_mj": Field("float", "mJ", "the job's part of energy_mj: all of it on a GPU it has to "
                                      "itself; shared, by its share of the processes' SM samples (job_sm_pct over "
                                      "job + others), else by job_mem_share", kind="counter"),
        "gpus[].energy_split": Field("str", "—", "how job_energy_mj was split: exclusive, sm_share, mem_share"),
        "gpus[].accounting": Field("bool", "—", "NVML accounting mode is on (exited processes are counted; "
                                   "`nvidia-smi -am 1`)"),
        "gpus[].exited": Field("list[map]", "—", "the job's processes on this GPU that exited since the last tick, "
                               "each once, from NVML accounting: {pid, gpu_util_pct and mem_util_pct (over its "
                               "life), max_mem_bytes, time_ms}"),
        "gpus[].util_gpu_pct": Field("int", "%", "time a kernel ran, over the driver's last sample period"),
        "gpus[].util_mem_pct": Field("int", "%", "time device memory was read or written, same period"),
        "gpus[].mem_used_bytes": Field("int", "bytes", "device memory used, all processes"),
        "gpus[].mem_total_bytes": Field("int", "bytes", "device memory installed"),
        "gpus[].sm_clock_mhz": Field("int", "MHz", "SM clock now"),
        "gpus[].mem_clock_mhz": Field("int", "MHz", "memory clock now"),
        "gpus[].power_mw": Field("int", "mW", "board power draw now"),
        "gpus[].energy_mj": Field("int", "mJ", "energy used this interval (nvmlDeviceGetTotalEnergyConsumption delta)"),
        "gpus[].temp_c": Field("int", "°C", "GPU core temperature"),
        "gpus[].pcie_tx_bytes_per_s": Field("int", "bytes/s", "PCIe transmit rate over NVML's 20 ms window"),
        "gpus[].pcie_rx_bytes_per_s": Field("int", "bytes/s", "PCIe receive rate over NVML's 20 ms window"),
        "gpus[].nvlink_tx_bytes": Field("int", "bytes", "NVLink data sent this interval, all links"),
        "gpus[].nvlink_rx_bytes": Field("int", "bytes", "NVLink data received this interval, all links"),
        "gpus[].clock_event_reasons": Field("int", "bitmask", "why clocks are held down now (nvmlClocksEventReason*)"),
        "gpus[].clock_event_names": Field("list[str]", "—", "clock_event_reasons decoded: sw_power_cap, "
                                          "hw_thermal_slowdown, …"),
        "gpus[].ecc_corrected": Field("int", "count", "corrected ECC errors this interval (volatile counter delta)"),
        "gpus[].ecc_uncorrected": Field("int", "count", "uncorrected ECC errors this interval"),
        # the two remapped_rows_* are NVML's running totals, not deltas: gauges
        "gpus[].remapped_rows_corrected": Field("int", "count", "rows remapped for corrected errors, lifetime",
                                                kind="gauge"),
        "gpus[].remapped_rows_uncorrected": Field("int", "count", "rows remapped for uncorrected errors, lifetime",
                                                  kind="gauge"),
        "gpus[].remap_pending": Field("bool", "—", "a remapping waits for a GPU reset"),
        "gpus[].remap_failure": Field("bool", "—", "a row remapping has failed"),
        "gpus[].xid_errors": Field("int", "count", "XID errors this interval (each also a gpu_xid event)"),
        "gpus[].gpm_sm_active_pct": Field("float", "%", "GPM: SMs busy, over the interval (Hopper+)"),
        "gpus[].gpm_sm_occupancy_pct": Field("float", "%", "GPM: resident warps vs the maximum, over the interval"),
        "gpus[].gpm_tensor_active_pct": Field("float", "%", "GPM: tensor cores busy, over the interval"),
        "gpus[].gpm_dram_bw_pct": Field("float", "%", "GPM: DRAM bandwidth used vs peak, over the interval"),
        "gpus[].ofu_pct": Field("float", "%", "OFU, Overall FLOP Utilization (arXiv 2605.20799): gpm_tensor_active_pct "
                                "× sm_clock_mhz / the SM clock's maximum — the share of the GPU's peak tensor "
                                "FLOP rate "
                                "its tensor activity amounts to at the clock it ran; absent without GPM"),
        "gpus[].mig": Field("list[map]", "—", "only on a GPU in MIG mode: the job's MIG devices on it (fields "
                            "gpus[].mig[].*); the GPU's other values are the whole GPU's, shared with other instances"),
        "gpus[].mig[].slot": Field("int", "—", "MIG device index on its GPU"),
        "gpus[].mig[].uuid": Field("str", "—", "MIG-UUID"),
        "gpus[].mig[].gpu_instance": Field("int", "—", "GPU instance id"),
        "gpus[].mig[].compute_instance": Field("int", "—", "compute instance id"),
        "gpus[].mig[].rule": Field("str", "—", "why it is the job's: process (a job PID on its process list) | env "
                                   "(a MIG-UUID in *_VISIBLE_DEVICES)"),
        "gpus[].mig[].mem_used_bytes": Field("int", "bytes", "memory used on this MIG device, all its processes"),
        "gpus[].mig[].mem_total_bytes": Field("int", "bytes", "memory of this MIG device"),
        "gpus[].mig[].shared": Field("bool", "—", "processes that are not the job's run on this MIG device"),
        "gpus[].mig[].job_procs": Field("int", "count", "job processes on it"),
        "gpus[].mig[].other_procs": Field("int", "count", "other processes on it"),
        "gpus[].mig[].job_mem_bytes": Field("int", "bytes", "memory of the job's processes on it"),
        "gpus[].mig[].procs": Field("list[map]", "—", "the job's processes on it: {pid, mem_bytes}"),
        "gpus[].mig[].gpm_sm_active_pct": Field("float", "%", "GPM of its GPU instance: SMs busy, over the interval"),
        "gpus[].mig[].gpm_sm_occupancy_pct": Field("float", "%", "GPM of its GPU instance: resident warps vs the "
                                                   "maximum"),
        "gpus[].mig[].gpm_tensor_active_pct": Field("float", "%", "GPM of its GPU instance: tensor cores busy"),
        "gpus[].mig[].gpm_dram_bw_pct": Field("float", "%", "GPM of its GPU instance: DRAM bandwidth used vs peak"),
    }

    def __init__(self, host: Host | None = None, nvml=None):
        super().__init__(host)
        self._nv = nvml            # the pynvml module (or a stand-in); imported at start when None
        self.nvml: Nvml | None = None
        self.target: Target | None = None
        self.rules: dict[int, str] = {}
        self.told_lost: set[int] = set()
        self.mig_rules: dict[Mig, str] = {}
        self.devcg = DeviceRules()

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why is not None or self._nv is not None:
            return why
        # found, not imported: the binding's module costs the agent ~1 MiB on a node with no GPU to read
        if importlib.util.find_spec("pynvml") is None:
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        try:
            ctypes.CDLL(LIBRARY)   # the same lookup pynvml makes; nothing is initialized
        except OSError:
            return NO_DRIVER
        return None

    def start(self, target: Target) -> None:
        nv = self._nv
        if nv is None:
            try:
                import pynvml as nv
            except ImportError as err:
                raise ProbeUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from err
        nvml = Nvml(nv)
        try:
            nvml.open()
        except nv.NVMLError as err:
            nvml.close()
            raise ProbeUnavailable(INIT_ERRORS.get(err.value, f"nvmlInit failed: {err}")) from err
        self.nvml, self.target, self.rules, self.told_lost = nvml, target, {}, set()
        self.seen_on: dict[int, set[int]] = {}      # GPU index → the job's pids seen on it, until their exit is told
        try:
            self.rules, _, self.mig_rules, _ = self._membership(set(target.pids()))
            for g in nvml.live():
                if g.index in self.rules:
                    try:
                        nvml.prime(g, counters=True)
                        for m in g.migs:
                            if m in self.mig_rules:
                                nvml.prime(m, counters=False)
                    except GpuLost:
                        self._mark_lost(g)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
        self.nvml = None
        self.target = None

    # ---- membership --------------------------------------------------------------------------------------
    def _mark_lost(self, g: Gpu) -> None:
        g.lost = True
        self.nvml.forget(g)
        for m in g.migs:
            self.nvml.forget(m)

    def _membership(self, pids: set[int]) -> tuple[dict[int, str], dict[int, dict], dict[Mig, str], dict[Mig, dict]]:
        """GPU index → rule for the job's GPUs now, and each readable GPU's process list (pid → bytes); the same for
        the job's MIG devices. A GPU one of whose MIG devices is the job's is the job's, by that device's rule."""
        nvml = self.nvml
        procs: dict[int, dict] = {}
        mig_procs: dict[Mig, dict] = {}
        migs: list[Mig] = []
        for g in nvml.live():
            try:
                p = nvml.processes(g)
                on_migs = {m: nvml.processes(m) for m in g.migs}
            except GpuLost:
                self._mark_lost(g)
                continue
            if p is not None:
                procs[g.index] = p
            migs += g.migs
            mig_procs.update((m, q) for m, q in on_migs.items() if q is not None)
        devices, env, env_migs = cgroup_and_env(nvml.gpus, pids, self.host.proc, self.host.mountinfo,
                                                self.host.cgroup2, self.devcg)
        mig_rules: dict[Mig, str] = {}
        for m in migs:
            if pids & mig_procs.get(m, {}).keys():
                mig_rules[m] = "process"
            elif (m.index, m.slot) in env_migs:
                mig_rules[m] = "env"
        by_migs = {}
        for m, rule in mig_rules.items():
            by_migs[m.index] = "process" if "process" in (rule, by_migs.get(m.index)) else rule
        rules: dict[int, str] = {}
        for g in nvml.gpus:
            if pids & procs.get(g.index, {}).keys():
                rules[g.index] = "process"
            elif g.index in devices:
                rules[g.index] = "devices"
            elif g.index in by_migs:
                rules[g.index] = by_migs[g.index]
            elif g.index in env:
                rules[g.index] = "env"
            elif g.lost and g.index in self.rules:
                rules[g.index] = self.rules[g.index]   # it was the job's when it fell off the bus
        return rules, procs, mig_rules, mig_procs

    # ---- one tick ----------------------------------------------------------------------------------------
    def sample(self) -> dict:
        nvml = self.nvml
        pids = set(self.target.pids())
        rules, procs, mig_rules, mig_procs = self._membership(pids)
        events: list[dict] = []
        xids: dict[int, int] = {}
        for g, xid in nvml.xids():
            if g.index in rules:   # another job's GPU: its XIDs are that job's story
                xids[g.index] = xids.get(g.index, 0) + 1
                events.append({"event": "gpu_xid", "gpu": g.index, "uuid": g.uuid, "xid": xid})
        gpus = []
        for g in nvml.gpus:
            rule = rules.get(g.index)
            if rule is None:
                if g.index in self.rules and not g.lost:
                    nvml.forget(g)   # left the job: a later return starts from fresh baselines
                    for m in g.migs:
                        nvml.forget(m)
                continue
            entry = {"index": g.index, "uuid": g.uuid, "name": g.name, "rule": rule, "lost": g.lost}
            if g.handle is not None and not g.lost:
                joined = g.index not in self.rules
                if joined:
                    nvml.forget(g)
                try:
                    entry.update(nvml.read(g))   # a GPU that just joined: gauges now, deltas from the next tick
                    if joined:
                        nvml.prime(g, counters=False)
                except GpuLost:
                    self._mark_lost(g)
                    entry = {k: entry[k] for k in ("index", "uuid", "name", "rule")}
                    entry["lost"] = True
            if g.lost:
                if g.index not in self.told_lost:
                    self.told_lost.add(g.index)
                    events.append({"event": "gpu_lost", "gpu": g.index, "uuid": g.uuid})
            else:
                entry["xid_errors"] = xids.get(g.index, 0)
                entry.update(self._attribution(procs.get(g.index), pids))
                try:
                    entry.update(self._share(g, procs.get(g.index), pids))
                except GpuLost:
                    self._mark_lost(g)
                if entry.get("mem_used_bytes") and "job_mem_bytes" in entry:
                    entry["job_mem_share"] = round(entry["job_mem_bytes"] / entry["mem_used_bytes"], 4)
                if "energy_mj" in entry:
                    entry.update(self._energy(entry))
                if g.migs:
                    entry["mig"] = self._migs(g, mig_rules, mig_procs, pids)
            gpus.append(entry)
        self.rules, self.mig_rules = rules, mig_rules
        out: dict = {"gpus": gpus, "ngpus": len(gpus), "node_gpus": len(nvml.gpus)}
        if not gpus:
            out["note"] = ("this node has no NVIDIA GPU" if not nvml.gpus else
                           f"the job uses none of the node's {len(nvml.gpus)} GPUs: none of its processes is on "
                           "NVML's process lists, names one in *_VISIBLE_DEVICES or has one in its device cgroup")
        fresh = nvml.take_fresh()
        if fresh:
            out["unsupported"] = fresh
        if events:
            out[EVENTS_KEY] = events
        return out

    def _migs(self, g: Gpu, rules: dict[Mig, str], procs: dict[Mig, dict], pids: set[int]) -> list[dict]:
        out = []
        for m in g.migs:
            if m not in rules:
                if m in self.mig_rules:
                    self.nvml.forget(m)   # left the job
                continue
            entry = {"slot": m.slot, "uuid": m.uuid, "gpu_instance": m.gi, "compute_instance": m.ci,
                     "rule": rules[m]}
            try:
                entry.update(self.nvml.mig_read(m))   # one that just joined: GPM from its next tick
                if m not in self.mig_rules:
                    self.nvml.prime(m, counters=False)
            except GpuLost:
                break          # the whole GPU: marked lost at its next read
            entry.update(self._attribution(procs.get(m), pids))
            out.append(entry)
        return out

    def _share(self, g: Gpu, procs: dict | None, pids: set[int]) -> dict:
        """The job's own share of the GPU: its processes' per-process utilization samples (each read once), the
        others' beside them, how the GPU is shared, and the job's processes that exited since the last tick
        (NVML accounting, once each). Raises GpuLost."""
        nvml, out = self.nvml, {}
        samples = nvml.process_samples(g)
        seen = self.seen_on.setdefault(g.index, set())
        if samples is not None:
            by_pid: dict[int, list[tuple]] = {}
            for pid, _, *vals in samples:
                by_pid.setdefault(pid, []).append(vals)

            def total(which: list[int], i: int) -> float:
                return round(sum(sum(v[i] for v in by_pid[p]) / len(by_pid[p]) for p in which), 2)
            mine = [p for p in by_pid if p in pids]
            others = [p for p in by_pid if p not in pids]
            out.update(job_sm_pct=total(mine, 0), job_mem_util_pct=total(mine, 1), job_enc_pct=total(mine, 2),
                       job_dec_pct=total(mine, 3), others_sm_pct=total(others, 0), util_samples=len(samples),
                       util_source=nvml.util_source())
            seen |= set(mine)
        if procs is not None:
            seen |= {p for p in procs if p in pids}
            mps = nvml.call(g, "mps_processes")
            out["sharing"] = "mig" if g.migs else "mps" if mps else \
                ("time-slicing" if any(p not in pids for p in procs) else "exclusive")
        gone = [p for p in seen if p not in pids]
        if gone:
            exited = []
            for pid in sorted(gone):
                rec = nvml.accounting(g, pid)
                if rec is None or not rec.pop("running"):
                    seen.discard(pid)          # told once (or never: no accounting), not asked again
                    if rec is not None:
                        exited.append(rec)
            if exited:
                out["exited"] = exited
        if "accounting_mode" not in nvml.missing and "accounting_mode" not in g.unsupported:
            out["accounting"] = nvml.call(g, "accounting_mode", fn=nvml.nv.nvmlDeviceGetAccountingMode) == 1
        return out

    @staticmethod
    def _energy(e: dict) -> dict:
        """The job's part of the GPU's energy this interval: all of it on a GPU it has to itself; on a shared one, by
        its share of the processes' SM samples, else of their memory (said in energy_split)."""
        if e.get("sharing") == "exclusive" or not e.get("shared", False):
            return {"job_energy_mj": e["energy_mj"], "energy_split": "exclusive"}
        busy = e.get("job_sm_pct", 0) + e.get("others_sm_pct", 0)
        if e.get("util_samples") and busy > 0:
            return {"job_energy_mj": round(e["energy_mj"] * e["job_sm_pct"] / busy, 3), "energy_split": "sm_share"}
        return {"job_energy_mj": round(e["energy_mj"] * e.get("job_mem_share", 0), 3), "energy_split": "mem_share"}

    @staticmethod
    def _attribution(procs: dict | None, pids: set[int]) -> dict:
        """Who is on the GPU: the job's processes and their memory, the others only counted."""
        if procs is None:   # no process list could be read: say nothing rather than guess
            return {}
        mine = {pid: mem for pid, mem in procs.items() if pid in pids}
        return {"shared": len(procs) > len(mine), "job_procs": len(mine), "other_procs": len(procs) - len(mine),
                "job_mem_bytes": sum(m for m in mine.values() if m is not None),
                "procs": [{"pid": pid, "mem_bytes": mem} for pid, mem in sorted(mine.items())]}
