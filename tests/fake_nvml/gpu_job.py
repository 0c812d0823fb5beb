# SPDX-License-Identifier: Apache-2.0
"""A stand-in GPU job for the end-to-end test: it puts itself on GPU INDEX's compute-process list in the fake
NVML's state file (with MEM bytes of GPU memory), as a CUDA process would appear to NVML, then sleeps SECONDS —
or, given SM (percent), writes a per-process utilization sample of SM% for itself every 0.1 s meanwhile, as the
driver samples a busy process.

    python gpu_job.py INDEX MEM SECONDS [SM]
"""
import os
import sys
import time

from state import FakeState

index, mem, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
st = FakeState.load(os.environ["FAKE_NVML_STATE"])
procs = st.gpus.setdefault(index, {}).get("procs", "")
st.gpu(index, procs=f"{procs} {os.getpid()}:{mem}".strip()).write()
print(f"gpu_job {os.getpid()} on GPU {index}", flush=True)
if len(sys.argv) > 4:
    sm, end, ts = int(sys.argv[4]), time.monotonic() + seconds, 1_000_000
    while time.monotonic() < end:
        ts += 100_000
        st = FakeState.load(os.environ["FAKE_NVML_STATE"])
        other = os.environ.get("FAKE_OTHER")      # "PID:SM": another process sampled beside it (a shared GPU)
        extra = f" {other.split(':')[0]}:{ts}:{other.split(':')[1]}:0:0:0" if other else ""
        st.gpu(index, putil=f"{os.getpid()}:{ts}:{sm}:0:0:0{extra}").write()
        time.sleep(0.1)
else:
    time.sleep(seconds)
