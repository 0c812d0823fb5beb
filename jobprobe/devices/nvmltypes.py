# SPDX-License-Identifier: Apache-2.0
"""nvmltypes — NVML's numbers and names as the gpu probe uses them, and the records it keeps per device.

What: the NVML return codes that decide what a failed call means (lost GPU, unsupported here, missing in this
  driver); the event, field and GPM metric ids and the simple gauges read each tick; the clock-event reason bits
  and their names (decode_reasons); the library's name and what each nvmlInit failure means (INIT_ERRORS); and Gpu
  and Mig, one per GPU and MIG device, with GpuLost for one that fell off the bus. The calls themselves are in
  jobprobe.devices.nvml (Nvml).
"""
from __future__ import annotations

import ctypes

LIBRARY = "libnvidia-ml.so.1"      # the name pynvml dlopen()s on Linux
GPU_IS_LOST, TIMEOUT, NOT_FOUND = 15, 10, 6      # NVML_ERROR_*
STICKY_GPU = {3: "not supported", 4: "no permission"}                      # this GPU will not, ever
MISSING = {13: "function not found", 25: "argument version mismatch"}       # this driver cannot, for any GPU
XID_EVENT = 0x8                    # nvmlEventTypeXidCriticalError
ALL_LINKS = 0xFFFFFFFF             # scopeId: nvml.h "a scopeId of UINT_MAX returns aggregate value … across all links"
NVLINK_FIELDS = {"nvlink_tx_bytes": 138, "nvlink_rx_bytes": 139}   # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX, KiB
NVLINK_LINK_COUNT = 91             # NVML_FI_DEV_NVLINK_LINK_COUNT
GPM_METRICS = {"gpm_sm_active_pct": 2, "gpm_sm_occupancy_pct": 3,          # NVML_GPM_METRIC_SM_UTIL, SM_OCCUPANCY,
               "gpm_tensor_active_pct": 5, "gpm_dram_bw_pct": 10}          # ANY_TENSOR_UTIL, DRAM_BW_UTIL
CLOCK_EVENT_NAMES = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                     0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                     0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
# Simple gauges: field, metric (the unit of "unsupported"), binding function, its extra arguments, scale.
GAUGES = (("sm_clock_mhz", "sm_clock", "nvmlDeviceGetClockInfo", (1,), 1),            # NVML_CLOCK_SM
          ("mem_clock_mhz", "mem_clock", "nvmlDeviceGetClockInfo", (2,), 1),          # NVML_CLOCK_MEM
          ("power_mw", "power", "nvmlDeviceGetPowerUsage", (), 1),
          ("temp_c", "temperature", "nvmlDeviceGetTemperature", (0,), 1),             # NVML_TEMPERATURE_GPU
          # NVML reports KB/s; NVML's KB is 1024 bytes (its NVLink counters say KiB outright)
          ("pcie_tx_bytes_per_s", "pcie", "nvmlDeviceGetPcieThroughput", (0,), 1024),
          ("pcie_rx_bytes_per_s", "pcie", "nvmlDeviceGetPcieThroughput", (1,), 1024))


NO_DRIVER = f"no NVIDIA driver ({LIBRARY} not found)"
INIT_ERRORS = {12: NO_DRIVER,                                                   # NVML_ERROR_LIBRARY_NOT_FOUND
               9: f"NVIDIA driver not loaded ({LIBRARY} found, no kernel driver)",   # DRIVER_NOT_LOADED
               18: "NVIDIA library and kernel driver versions differ (reload the driver)",  # LIB_RM_VERSION_MISMATCH
               4: "no permission to use NVML"}                                  # NO_PERMISSION


def decode_reasons(mask: int) -> list[str]:
    names = [name for bit, name in CLOCK_EVENT_NAMES.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENT_NAMES)
    return names + [f"bit{b}" for b in range(64) if rest >> b & 1]


class GpuLost(Exception):
    """NVML says this GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST)."""


class Gpu:
    def __init__(self, index: int, handle=None):
        self.index, self.handle = index, handle
        self.uuid: str | None = None
        self.name: str | None = None
        self.minor: int | None = None           # /dev/nvidiaN: what a v1 device cgroup lists as 195:N
        self.lost = False                         # fell off the bus: never asked anything again
        self.sm_clock_max: int | None = None      # MHz, the SM clock's maximum: the clock peak FLOPs are rated at
        self.unsupported: set[str] = set()
        self.prev: dict[str, int] = {}           # counters at the last read, for deltas
        self.gpm: list | None = None             # [previous sample, spare sample] while GPM runs
        self.nvlinks: int | None = None          # set when the driver refuses the all-links scope: sum per link
        self.migs: list[Mig] = []                # its MIG devices, when MIG mode is on
        self.util_seen = 0                       # µs: the newest per-process utilization sample read
        # Event data names the GPU by handle: compare the pointers' values.
        self.addr = ctypes.cast(handle, ctypes.c_void_p).value if handle is not None else None

    @property
    def label(self) -> str:
        return f"gpu{self.index}"


class Mig(Gpu):
    """A MIG device (a GPU instance's compute instance) of a GPU in MIG mode: its own handle, UUID (MIG-…), memory
    and process list; utilization, clocks, power and the rest are the whole GPU's."""

    def __init__(self, parent: Gpu, slot: int, handle):
        super().__init__(parent.index, handle)
        self.parent, self.slot = parent, slot
        self.gi: int | None = None
        self.ci: int | None = None

    @property
    def label(self) -> str:
        return f"gpu{self.index}.mig{self.slot}"


def gpm_metric(g: Gpu) -> str:
    """The metric a device's GPM figures are counted under: a MIG device's come from its GPU instance."""
    return "mig_gpm" if isinstance(g, Mig) else "gpm"
