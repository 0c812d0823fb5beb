"""A stand-in GPU job for the end-to-end test: it puts itself on GPU INDEX's compute-process list in the fake
NVML's state file (with MEM bytes of GPU memory), as a CUDA process would appear to NVML, then sleeps SECONDS.

    python gpu_job.py INDEX MEM SECONDS
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
time.sleep(seconds)
