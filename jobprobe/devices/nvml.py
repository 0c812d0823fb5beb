# SPDX-License-Identifier: Apache-2.0
"""nvml — the gpu probe's one door to NVML, through nvidia-ml-py's `pynvml` (which loads libnvidia-ml.so.1).

What this adds to the binding:
- Sticky unsupported: a call a GPU refuses (NVML_ERROR_NOT_SUPPORTED, NO_PERMISSION) is recorded for that GPU, one
  the driver lacks (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH) for every GPU; either is reported once (`fresh`)
  and never called again. Where the binding has an older name for the same thing (…ClocksThrottleReasons before
  driver 535, nvmlDeviceGetMemoryInfo before _v2) the older one is tried before giving up.
- A GPU that falls off the bus (NVML_ERROR_GPU_IS_LOST) raises GpuLost: the probe marks it lost and goes on.
- Counters become per-interval deltas (energy, volatile ECC, NVLink KiB); GPM metrics come from two samples, the
  previous tick's and this one's; XID errors are drained from one event set with timeout 0, never waited for.

Needs: nvidia-ml-py >= 12 and a driver that has the functions (R450+ for most; GPM: Hopper and R520+; NVLink
throughput fields: R515+). Cost: about 15 NVML calls per job GPU per tick; nvmlDeviceGetPcieThroughput measures over
a 20 ms window inside the driver, the slowest call here. NVML's codes and ids and the per-device records (Gpu, Mig):
jobprobe.devices.nvmltypes.
"""
from __future__ import annotations

import ctypes
import logging

from jobprobe.core.counters import delta
from jobprobe.devices.nvmltypes import (
    ALL_LINKS,
    GAUGES,
    GPM_METRICS,
    GPU_IS_LOST,
    MISSING,
    NOT_FOUND,
    NVLINK_FIELDS,
    NVLINK_LINK_COUNT,
    STICKY_GPU,
    TIMEOUT,
    XID_EVENT,
    Gpu,
    GpuLost,
    Mig,
    decode_reasons,
    gpm_metric,
)

log = logging.getLogger("jobprobe.gpu")


class Nvml:
    def __init__(self, nv):
        self.nv = nv
        self.gpus: list[Gpu] = []
        self.missing: set[str] = set()           # metrics this driver lacks, for every GPU
        self.fresh: list[str] = []               # unsupported found since take_fresh(): reported once
        self.eventset = None
        self.inited = False
        names = {"memory": ["_memory_v2", "nvmlDeviceGetMemoryInfo"],
                 "clock_event_reasons": ["nvmlDeviceGetCurrentClocksEventReasons",
                                         "nvmlDeviceGetCurrentClocksThrottleReasons"],
                 "compute_processes": ["nvmlDeviceGetComputeRunningProcesses_v3",
                                       "nvmlDeviceGetComputeRunningProcesses_v2"],
                 "graphics_processes": ["nvmlDeviceGetGraphicsRunningProcesses_v3",
                                        "nvmlDeviceGetGraphicsRunningProcesses_v2"],
                 "mps_processes": ["nvmlDeviceGetMPSComputeRunningProcesses_v3"],
                 "process_util": ["_util_info", "_util_samples"]}
        # metric → the functions to try, newest first; one the driver lacks is dropped for good (all GPUs)
        self.fns = {m: [f for n in ns if (f := getattr(self, n, None) or getattr(nv, n, None))]
                    for m, ns in names.items()}

    def _memory_v2(self, handle):
        return self.nv.nvmlDeviceGetMemoryInfo(handle, version=self.nv.nvmlMemory_v2)

    # Per-process utilization samples newer than `since` (µs), newest API first; NVML_ERROR_NOT_FOUND is "no sample
    # since then", not a failure.
    def _util_info(self, handle, since):
        return self._no_samples_ok(self.nv.nvmlDeviceGetProcessesUtilizationInfo, handle, since)

    def _util_samples(self, handle, since):
        return self._no_samples_ok(self.nv.nvmlDeviceGetProcessUtilization, handle, since)

    def _no_samples_ok(self, fn, handle, since):
        try:
            return fn(handle, since)
        except self.nv.NVMLError as err:
            if err.value == NOT_FOUND:
                return []
            raise

    def util_source(self) -> str | None:
        """Which call gives per-process utilization on this driver (None: neither)."""
        fns = self.fns.get("process_util") or []
        if "process_util" in self.missing or not fns:
            return None
        return "ProcessesUtilizationInfo" if fns[0].__name__ == "_util_info" else "ProcessUtilization"

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> None:
        """nvmlInit, every GPU's handle and identity, one event set for XIDs. Raises NVMLError from nvmlInit."""
        nv = self.nv
        nv.nvmlInit()
        self.inited = True
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                g = Gpu(i, nv.nvmlDeviceGetHandleByIndex(i))
            except nv.NVMLError as err:     # lost before we came, or unusable: keep its place, say why
                log.warning("GPU %d: %s", i, err)
                g = Gpu(i)
                g.lost = err.value == GPU_IS_LOST
                if not g.lost:
                    self.fresh.append(f"gpu{i}.handle")
                self.gpus.append(g)
                continue
            self.gpus.append(g)
            try:
                g.uuid = self.call(g, "uuid", fn=nv.nvmlDeviceGetUUID)
                g.name = self.call(g, "name", fn=nv.nvmlDeviceGetName)
                g.minor = self.call(g, "minor", fn=nv.nvmlDeviceGetMinorNumber)
                g.sm_clock_max = self.call(g, "sm_clock_max", 1, fn=nv.nvmlDeviceGetMaxClockInfo)  # NVML_CLOCK_SM
                g.migs = self._migs(g)
            except GpuLost:
                g.lost = True
        self.eventset = self.call_global("xid", nv.nvmlEventSetCreate)
        for g in self.live() if self.eventset is not None else ():
            try:
                self.call(g, "xid", XID_EVENT, self.eventset, fn=nv.nvmlDeviceRegisterEvents)
            except GpuLost:
                g.lost = True

    def _migs(self, g: Gpu) -> list[Mig]:
        """The MIG devices of a GPU in MIG mode (slots without one are skipped). MIG is a mode, not a metric: a
        GPU or driver without it is not reported as unsupported. Raises GpuLost."""
        nv, out = self.nv, []
        try:
            if nv.nvmlDeviceGetMigMode(g.handle)[0] != 1:      # NVML_DEVICE_MIG_ENABLE
                return out
            slots = nv.nvmlDeviceGetMaxMigDeviceCount(g.handle)
        except nv.NVMLError as err:
            if err.value == GPU_IS_LOST:
                raise GpuLost(f"GPU {g.index}: {err}") from err
            return out
        for slot in range(slots):
            try:
                m = Mig(g, slot, nv.nvmlDeviceGetMigDeviceHandleByIndex(g.handle, slot))
                m.uuid = nv.nvmlDeviceGetUUID(m.handle)
                m.gi = nv.nvmlDeviceGetGpuInstanceId(m.handle)
                m.ci = nv.nvmlDeviceGetComputeInstanceId(m.handle)
            except nv.NVMLError as err:            # NVML_ERROR_NOT_FOUND: no MIG device in this slot
                if err.value == GPU_IS_LOST:
                    raise GpuLost(f"GPU {g.index}: {err}") from err
                continue
            out.append(m)
        return out

    def mig_read(self, m: Mig) -> dict:
        """A MIG device's own values: memory used and total, its GPU instance's GPM metrics. Raises GpuLost."""
        got = self.call(m, "memory")
        out = {} if got is None else {"mem_used_bytes": got.used, "mem_total_bytes": got.total}
        out.update(self._gpm(m))
        return out

    def close(self) -> None:
        """Free GPM samples and the event set, then nvmlShutdown. Idempotent; errors here are only logged."""
        nv = self.nv
        for g in self.gpus:
            for m in g.migs:
                self.forget(m)
            self.forget(g)
        if self.eventset is not None:
            self._quiet(nv.nvmlEventSetFree, self.eventset)
            self.eventset = None
        if self.inited:
            self.inited = False
            self._quiet(nv.nvmlShutdown)

    def _quiet(self, fn, *args) -> None:
        """Teardown: what fails here can only be logged."""
        try:
            fn(*args)
        except self.nv.NVMLError as err:
            log.debug("%s: %s", fn.__name__, err)

    def live(self) -> list[Gpu]:
        """GPUs we can ask: a handle, and still on the bus."""
        return [g for g in self.gpus if g.handle is not None and not g.lost]

    def take_fresh(self) -> list[str]:
        fresh, self.fresh = self.fresh, []
        return fresh

    # ---- calls -------------------------------------------------------------------------------------------
    def call(self, g: Gpu, metric: str, *args, fn=None):
        """fn(g.handle, *args) (or the metric's functions in turn). None when the metric is unsupported (recorded
        once, never asked again) or failed this once. Raises GpuLost."""
        if metric in self.missing or metric in g.unsupported:
            return None
        fns = self.fns[metric] if fn is None else [fn]
        while fns:
            try:
                return fns[0](g.handle, *args)
            except self.nv.NVMLError as err:
                code = err.value
                if code == GPU_IS_LOST:
                    raise GpuLost(f"GPU {g.index}: {err}") from err
                if code in MISSING:   # this driver lacks it: try its older name for the same thing, if any
                    fns.pop(0)
                    continue
                if code in STICKY_GPU:
                    g.unsupported.add(metric)
                    self.fresh.append(f"{g.label}.{metric}")
                else:                 # transient (timeout, unknown): absent this tick, asked again next
                    log.debug("GPU %d %s: %s", g.index, metric, err)
                return None
        self.missing.add(metric)      # no function left for it in this driver (or this binding): every GPU
        self.fresh.append(metric)
        return None

    def call_global(self, metric: str, fn, *args):
        if metric in self.missing:
            return None
        try:
            return fn(*args)
        except self.nv.NVMLError as err:
            if err.value in MISSING or err.value in STICKY_GPU:
                self.missing.add(metric)
                self.fresh.append(metric)
            else:
                log.debug("%s: %s", metric, err)
            return None

    # ---- what runs on a GPU ------------------------------------------------------------------------------
    def processes(self, g: Gpu) -> dict[int, int | None] | None:
        """pid → bytes of GPU memory (None where NVML cannot tell) from the compute, graphics and MPS lists (a MIG
        device: its compute list); None when no list could be read. Raises GpuLost."""
        out: dict[int, int | None] = {}
        seen = False
        lists = ("compute_processes",) if isinstance(g, Mig) else \
            ("compute_processes", "graphics_processes", "mps_processes")
        for metric in lists:
            procs = self.call(g, metric)
            if procs is None:
                continue
            seen = True
            for p in procs:   # one process may be on two lists: count its memory once
                mem = p.usedGpuMemory
                out[p.pid] = mem if out.get(p.pid) is None else max(out[p.pid], mem or 0)
        return out if seen else None

    def process_samples(self, g: Gpu) -> list[tuple[int, int, int, int, int, int]] | None:
        """(pid, µs, sm %, mem %, enc %, dec %) of every per-process sample the driver took since the last call for
        this GPU — each sample once; None when the driver cannot say. Raises GpuLost."""
        got = self.call(g, "process_util", g.util_seen)
        if got is None:
            return None
        out = [(s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in got]
        if out:
            g.util_seen = max(g.util_seen, max(s[1] for s in out))
        return out

    def accounting(self, g: Gpu, pid: int) -> dict | None:
        """NVML's accounting record of one process on this GPU (the driver keeps it after the process exits, when
        accounting mode is on), or None (mode off, no record). Raises GpuLost."""
        if self.call(g, "accounting_mode", fn=self.nv.nvmlDeviceGetAccountingMode) != 1:
            return None
        st = self.call(g, "accounting_stats", pid, fn=self.nv.nvmlDeviceGetAccountingStats)
        if st is None:
            return None
        return {"pid": pid, "gpu_util_pct": st.gpuUtilization, "mem_util_pct": st.memoryUtilization,
                "max_mem_bytes": st.maxMemoryUsage, "time_ms": st.time, "running": bool(st.isRunning)}

    # ---- per-tick values -----------------------------------------------------------------------------------
    def prime(self, g: Gpu, counters: bool) -> None:
        """Baselines for a GPU that just became the job's: the first GPM sample, and (at start) the counters, so
        that the next read reports deltas over one whole interval."""
        if counters:
            g.prev = self.counters(g)
        if not isinstance(g, Mig):
            self.process_samples(g)       # the samples before it was the job's: read and left behind
        self.free_gpm(g)                  # (a GPU back in the job: its old samples go first)
        metric = gpm_metric(g)
        if metric in g.unsupported or metric in self.missing:
            return
        whole = g.parent.handle if isinstance(g, Mig) else g.handle
        support = self.call(g, metric, fn=lambda _handle: self.nv.nvmlGpmQueryDeviceSupport(whole))
        if support is not None and not support.isSupportedDevice:
            g.unsupported.add(metric)
            self.fresh.append(f"{g.label}.gpm")
        elif support is not None:
            samples = [self.call_global("gpm", self.nv.nvmlGpmSampleAlloc) for _ in range(2)]
            g.gpm = [s for s in samples if s is not None]
            if len(g.gpm) < 2 or self._gpm_sample(g, g.gpm[0]) is None:
                self.free_gpm(g)

    def _gpm_sample(self, g: Gpu, sample):
        """Take a GPM sample of a GPU, or of a MIG device's GPU instance (through the whole GPU's handle). Kept
        apart as its own metric: a driver without the MIG call loses only that."""
        if isinstance(g, Mig):
            return self.call(g, gpm_metric(g), sample,
                             fn=lambda _handle, s: self.nv.nvmlGpmMigSampleGet(g.parent.handle, g.gi, s))
        return self.call(g, "gpm", sample, fn=self.nv.nvmlGpmSampleGet)

    def forget(self, g: Gpu) -> None:
        """Drop a GPU's baselines: it left the job, or is lost."""
        g.prev = {}
        self.free_gpm(g)

    def free_gpm(self, g: Gpu) -> None:
        for s in g.gpm or ():
            self._quiet(self.nv.nvmlGpmSampleFree, s)
        g.gpm = None

    def counters(self, g: Gpu) -> dict[str, int]:
        """Running totals now: energy (mJ), volatile ECC counts, NVLink data (bytes)."""
        nv, now = self.nv, {}
        v = self.call(g, "energy", fn=nv.nvmlDeviceGetTotalEnergyConsumption)
        if v is not None:
            now["energy_mj"] = v
        for key, err_type in (("ecc_corrected", 0), ("ecc_uncorrected", 1)):   # NVML_MEMORY_ERROR_TYPE_*
            v = self.call(g, "ecc", err_type, 0, fn=nv.nvmlDeviceGetTotalEccErrors)  # 0: NVML_VOLATILE_ECC
            if v is not None:
                now[key] = v
        now.update(self._nvlink(g))
        return now

    def _nvlink(self, g: Gpu) -> dict[str, int]:
        # Ask for the all-links aggregate explicitly: pynvml leaves scopeId 0 (link 0 only) for a bare field id.
        if g.nvlinks is None:
            got = self.call(g, "nvlink", [(f, ALL_LINKS) for f in NVLINK_FIELDS.values()],
                            fn=self.nv.nvmlDeviceGetFieldValues)
            if got is None:
                return {}
            rets = {v.nvmlReturn for v in got}
            if rets == {0}:
                return {k: v.value.ullVal * 1024 for k, v in zip(NVLINK_FIELDS, got)}
            if rets & set(STICKY_GPU):
                g.unsupported.add("nvlink")
                self.fresh.append(f"gpu{g.index}.nvlink")
                return {}
            # A driver that refuses the aggregate scope: from now on, sum the links one by one.
            n = self.call(g, "nvlink", [NVLINK_LINK_COUNT], fn=self.nv.nvmlDeviceGetFieldValues)
            g.nvlinks = n[0].value.uiVal if n is not None and n[0].nvmlReturn == 0 else 0
        out = {}
        for key, field in NVLINK_FIELDS.items():
            per = self.call(g, "nvlink", [(field, k) for k in range(g.nvlinks)], fn=self.nv.nvmlDeviceGetFieldValues)
            if per and all(v.nvmlReturn == 0 for v in per):
                out[key] = sum(v.value.ullVal for v in per) * 1024
        return out

    def read(self, g: Gpu) -> dict:
        """This tick's values for one GPU of the job. Raises GpuLost."""
        nv, out = self.nv, {}
        u = self.call(g, "utilization", fn=nv.nvmlDeviceGetUtilizationRates)
        if u is not None:
            out.update(util_gpu_pct=u.gpu, util_mem_pct=u.memory)
        m = self.call(g, "memory")
        if m is not None:
            out.update(mem_used_bytes=m.used, mem_total_bytes=m.total)
        for field, metric, name, args, scale in GAUGES:
            v = self.call(g, metric, *args, fn=getattr(nv, name))
            if v is not None:
                out[field] = v * scale
        mask = self.call(g, "clock_event_reasons")
        if mask is not None:
            out.update(clock_event_reasons=mask, clock_event_names=decode_reasons(mask))
        rows = self.call(g, "remapped_rows", fn=nv.nvmlDeviceGetRemappedRows)
        if rows is not None:
            out.update(remapped_rows_corrected=rows[0], remapped_rows_uncorrected=rows[1],
                       remap_pending=bool(rows[2]), remap_failure=bool(rows[3]))
        now = self.counters(g)
        for k, v in now.items():          # a counter seen for the first time has no delta yet: absent
            if k in g.prev:
                out[k] = delta(v, g.prev[k])
        g.prev = now
        out.update(self._gpm(g))
        if "gpm_tensor_active_pct" in out and out.get("sm_clock_mhz") and g.sm_clock_max:
            out["ofu_pct"] = round(out["gpm_tensor_active_pct"] * out["sm_clock_mhz"] / g.sm_clock_max, 3)
        return out

    def _gpm(self, g: Gpu) -> dict[str, float]:
        if not g.gpm:
            return {}
        nv = self.nv
        prev, cur = g.gpm
        if self._gpm_sample(g, cur) is None:
            return {}
        wanted = {k: v for k, v in GPM_METRICS.items() if k not in g.unsupported}
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, len(wanted), prev, cur
        for i, mid in enumerate(wanted.values()):
            mg.metrics[i].metricId = mid
        g.gpm = [cur, prev]   # this sample starts the next interval
        if self.call(g, gpm_metric(g), fn=lambda _handle: nv.nvmlGpmMetricsGet(mg)) is None:
            return {}
        out = {}
        for i, key in enumerate(wanted):
            ret = mg.metrics[i].nvmlReturn
            if ret == 0:
                out[key] = round(mg.metrics[i].value, 3)
            elif ret in STICKY_GPU:
                g.unsupported.add(key)
                self.fresh.append(f"{g.label}.{key}")
        return out

    def xids(self, limit: int = 256) -> list[tuple[Gpu, int]]:
        """XID errors since the last call: (GPU, xid). Waits for nothing (timeout 0)."""
        if self.eventset is None:
            return []
        by_addr = {g.addr: g for g in self.gpus if g.addr is not None}
        out = []
        for _ in range(limit):    # bounded: an XID storm must not stall the tick
            try:
                data = self.nv.nvmlEventSetWait_v2(self.eventset, 0)
            except self.nv.NVMLError as err:
                if err.value != TIMEOUT:
                    log.debug("nvmlEventSetWait: %s", err)
                break
            g = by_addr.get(ctypes.cast(data.device, ctypes.c_void_p).value)
            if g is not None and data.eventType & XID_EVENT:
                out.append((g, int(data.eventData)))
        return out
