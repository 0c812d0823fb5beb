# SPDX-License-Identifier: Apache-2.0
"""A data-parallel training job across processes: PyTorch DDP, gloo backend, CPU — the shape of a multi-node job,
small enough for a laptop. Every rank computes the same work per step and waits for the others at each step's
gradient all-reduce, so the slowest rank sets the pace.

    python scripts/ddp_job.py --rank R --world N --master ADDR:PORT [--seconds S] [--width W] [--threads T]
                              [--work FILE]

Each rank prints one line per 20 steps (`rank R step K: X steps/s, blocked in collectives B s at T`: B its main
thread's blocked time so far in the collectives — the all-reduce its backward pass waits for, the stop broadcast —,
T the UNIX time) and a last line with its totals. `--work FILE`:
every 20 steps the rank reads a number from FILE (when it exists) and does that many times the work per step
(forward and backward passes, the extra ones accumulated without an all-reduce, as micro-batches of a bigger batch
would be) — a rank given more work than the others, the job's own imbalance. tests/
test_stragglers.py runs three ranks in three network namespaces, each probed as its own node.
"""
from __future__ import annotations

import argparse
import os
import time

from train_cpu import schedstat  # (scripts/, beside this one: the same reading of a thread's schedstat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--width", type=int, default=256, help="hidden width: the compute and the gradient size")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ifname", default=None, help="GLOO_SOCKET_IFNAME: the interface gloo talks over")
    ap.add_argument("--work", default=None, help="a file holding this rank's batch factor (read every 20 steps)")
    ap.add_argument("--data", default=None, help="a file this rank reads --read-mb of per step, round and round "
                    "(synchronous data loading in the training thread)")
    ap.add_argument("--read-mb", type=int, default=8)
    ap.add_argument("--gpu-ms", type=float, default=0.0, help="a blocking wait per step for a (fake) GPU's work")
    ap.add_argument("--gpu-file", default=None, help="a file holding the factor of --gpu-ms (its GPU's slowness; "
                    "read every 20 steps)")
    a = ap.parse_args()

    if a.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.rank)
    addr, port = a.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=a.rank, world_size=a.world)
    model = DDP(nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.ReLU(),
                              nn.Linear(a.width, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(a.batch, a.width)
    y = torch.randint(0, 10, (a.batch,))
    factor, credit, gpu = 1.0, 0.0, 1.0
    loss_fn = nn.CrossEntropyLoss()
    t0 = last = time.monotonic()
    steps = done = 0
    clock = Blocked()
    stop = torch.zeros(1)
    data = open(a.data, "rb", buffering=0) if a.data else None
    chunk = bytearray(a.read_mb << 20)
    while True:
        if data is not None and data.readinto(chunk) < len(chunk):
            data.seek(0)
        opt.zero_grad()
        # `factor` times the work per step: as many forward and backward passes on average, the extra ones with
        # their gradients accumulated locally (no all-reduce), as a bigger batch in micro-batches would be
        credit += factor
        passes = max(1, int(credit))
        credit -= passes
        for _ in range(passes - 1):
            with model.no_sync():
                loss_fn(model(x), y).backward()
        with clock:                         # the pass whose gradients are all-reduced: its wait for the peers
            loss_fn(model(x), y).backward()
        if a.gpu_ms:
            time.sleep(a.gpu_ms * gpu / 1000)
        opt.step()
        steps += 1
        if steps % 20 == 0:
            now = time.monotonic()
            print(f"rank {a.rank} step {steps}: {20 / (now - last):.1f} steps/s, blocked in collectives "
                  f"{clock.blocked:.3f} s at {time.time():.3f}", flush=True)
            last = now
            gpu = work_factor(a.gpu_file, gpu)
            f = work_factor(a.work, factor)
            if f != factor:
                factor = f
                print(f"rank {a.rank} step {steps}: work x{f:g}", flush=True)
            # every rank stops at the same step: rank 0 decides, the others follow its word
            stop[0] = 1.0 if now - t0 >= a.seconds else 0.0
            with clock:
                dist.broadcast(stop, 0)
            if stop[0] > 0:
                done = steps
                break
    print(f"rank {a.rank} done: {done} steps in {time.monotonic() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


class Blocked:
    """The calling thread's blocked time inside `with` blocks: wall time less its time on a CPU and its wait for one
    (its schedstat, as train_cpu.py reads it) — in a collective, the time it waits for its peers (and their bytes)."""

    def __init__(self):
        self.blocked = 0.0
        self._at = (0.0, 0.0, 0.0)

    def __enter__(self):
        self._at = (time.monotonic(), *schedstat())

    def __exit__(self, *exc):
        (w0, ran0, delay0), (w1, (ran1, delay1)) = self._at, (time.monotonic(), schedstat())
        self.blocked += max(0.0, (w1 - w0) - (ran1 - ran0) - (delay1 - delay0))


def work_factor(path: str | None, current: float) -> float:
    """The batch factor FILE holds now: `current` where there is none or it is not a positive number."""
    if not path:
        return current
    try:
        with open(path) as f:
            v = float(f.read().strip() or "1")
    except (OSError, ValueError):
        return current
    return v if 0 < v <= 100 else current


if __name__ == "__main__":
    main()
