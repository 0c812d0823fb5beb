# SPDX-License-Identifier: Apache-2.0
"""A GPU per rank for the DDP harness on a machine without one — a FAKE, named as such: the tests' fake
libnvidia-ml (tests/fake_nvml: a test double that drives no GPU, built from the checkout, never installed) answers each
node's agent through the real pynvml and the real gpu probe, one state file per node; the rank's "GPU work" is a
blocking wait of `gpu_ms` per step in its training thread (as a CUDA synchronize that sleeps), scaled by the factor
its GPU file holds.

A slow GPU (`slow`): the rank's GPU at half its SM clock — its per-step wait doubles, and its node's NVML says so:
SM clock 990 MHz of 1980, a thermal clock-event reason, utilization 97% (the same work at half the clock keeps it
busier)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "fake_nvml"
SW_THERMAL = 0x20          # nvmlClocksEventReasonSwThermalSlowdown


def _state_module() -> Any:
    spec = importlib.util.spec_from_file_location("jobprobe_fake_nvml_state", FAKE / "state.py")
    if spec is None or spec.loader is None or not (FAKE / "fake_nvml.c").exists():
        raise FileNotFoundError(f"the fake NVML is not in this checkout ({FAKE}): a slow GPU needs it")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeGpus:
    def __init__(self, out_dir: Path, world: int):
        self.mod = _state_module()
        self.lib_dir = out_dir / "fake-nvml"
        self.lib_dir.mkdir(exist_ok=True)
        self.mod.build(self.lib_dir)
        self.states = [self.mod.FakeState(out_dir / f"rank{i}.nvml") for i in range(world)]
        self.factor = [out_dir / f"rank{i}.gpu" for i in range(world)]
        for i in range(world):
            self.slow(i, False)

    def attach(self, rank: int, pid: int) -> None:
        """Rank `pid` runs on its node's GPU 0 (what NVML lists as a compute process of it)."""
        self.states[rank].gpu(0, procs=f"{pid}:{1 << 30}", mem=f"{80 << 30} {1 << 30}")
        self.slow(rank, False)

    def slow(self, rank: int, on: bool) -> None:
        self.states[rank].gpu(0, clocks="990 2619" if on else "1980 2619", throttle=SW_THERMAL if on else 0,
                              util="97 40" if on else "55 30").write()
        self.factor[rank].write_text("2\n" if on else "1\n")

    def env(self, rank: int) -> dict[str, str]:
        """What node `rank`'s agent needs to see its fake GPU."""
        return {"LD_LIBRARY_PATH": str(self.lib_dir), "FAKE_NVML_STATE": str(self.states[rank].path)}
