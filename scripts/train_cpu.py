# SPDX-License-Identifier: Apache-2.0
"""Reference training job: a small ResNet-style CNN on synthetic images, a fixed number of steps.

    python scripts/train_cpu.py [--steps N] [--batch B] [--size PX] [--width C] [--blocks K] [--threads T]
                                [--device cpu|cuda] [--loader-workers W] [--stall-every N --stall-s S]
                                [--seconds S] [--startup-s S] [--checkpoint-every K --checkpoint-mib M]
                                [--timeline FILE] [--exit-code N]

With --loader-workers (or --stall-every) the batches come from a DataLoader with W worker processes over a
synthetic dataset; --stall-every N makes every N-th batch wait S seconds in its worker (`slow_storage_read`: slow
storage, simulated with a sleep) — an input-bound job, for the `input_bound` rule and its deep-trace window.
--seconds S stops after S seconds even if steps remain (a job of a known length on any machine's speed);
--run-seconds S stops S seconds after its first step (steps of a known length, however long its imports took).
Known badput, for the time decomposition's tests: --startup-s S waits S seconds before its first step (a model read
from slow storage); --checkpoint-every K writes M MiB (--checkpoint-mib) to --checkpoint-dir and fsyncs them every K
steps. The job clocks itself: the last line says how long it took from its process's start to its first step
(startup_s), how long its steps waited for their batch, blocked (input_s: the calls' time less the thread's own CPU
and wait for a CPU in them, by its schedstat; input_wall_s: the calls' whole time), how long its checkpoints took
(checkpoint_s: writing and waiting for the disk, less its wait for a CPU in them; checkpoint_wall_s: all) and the
rest of its steps (compute_s), and how long its threads waited for a CPU by the kernel's count (run_delay_s; its
main thread's alone: main_run_delay_s — what it waits after its last line, in its teardown, is the difference between
this and that thread's count once the process has exited; from its first step to its last: steps_run_delay_s).
--timeline FILE writes each of those waits as it happened, in UNIX time (JSON: {"first_step": t, "last": t,
"input": [[t0, t1, blocked_s], …], "checkpoint": [[t0, t1, counted_s], …]}): the truth of each interval, beside the
frames' own t and dt.

scripts/train_gpu.py runs the same job with --device cuda (and a larger default size) for GPU machines.

Uses PyTorch when it imports; otherwise a NumPy stand-in with the same shape of work (a two-layer network trained
with plain matrix products) so that the demo runs anywhere. Prints one line at the end: steps, seconds, framework.
"""
from __future__ import annotations

import argparse
import time


def slow_storage_read(seconds: float) -> None:
    """Where an input-bound job waits: a read from slow storage (here a sleep, so it needs no slow disk)."""
    time.sleep(seconds)


def process_age_s() -> float:
    """Seconds since this process started (its start time in /proc/self/stat, against the system's uptime)."""
    import os
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return max(0.0, up - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Clock:
    """The job's own account of its seconds: startup, waiting for a batch, checkpointing, computing."""

    def __init__(self, a):
        self.a = a
        self.startup_s = self.input_s = self.input_wall_s = self.checkpoint_s = self.checkpoint_wall_s = 0.0
        self.first = self.last = self.saved = 0.0
        self.delay_first = self.delay_last = 0.0    # the main thread's wait for a CPU at the first step, the last
        self.input_at_save = 0.0        # input_s when the last checkpoint was written
        self.spans: dict[str, list[list[float]]] = {"input": [], "checkpoint": []}    # UNIX times, --timeline
        self.unix = time.time() - time.monotonic()      # monotonic + this = UNIX time

    def span(self, kind: str, mono0: float, mono1: float, *counted: float) -> None:
        self.spans[kind].append([mono0 + self.unix, mono1 + self.unix, *counted])

    def first_step(self) -> None:
        self.startup_s = process_age_s()
        self.first = self.last = time.monotonic()
        self.delay_first = self.delay_last = schedstat()[1]
        if self.a.run_seconds:                 # --run-seconds: the steps' own length, whatever the imports took
            self.a.deadline = self.first + self.a.run_seconds

    def batch(self, it):
        """The next batch of `it` (None at its end). Its wait is waiting for input: the time the thread spent in the
        call blocked — neither on a CPU (receiving the batch: unpickling it, mapping its shared memory) nor waiting
        for one (run_delay), by this thread's schedstat (input_wall_s: the whole call)."""
        t, (ran, delay) = time.monotonic(), schedstat()
        try:
            return next(it)
        except StopIteration:
            return None
        finally:
            now, (ran_now, delay_now) = time.monotonic(), schedstat()
            blocked = max(0.0, now - t - (ran_now - ran) - (delay_now - delay))
            self.input_wall_s += now - t
            self.input_s += blocked
            self.span("input", t, now, blocked)

    def after_step(self, step: int) -> None:
        a = self.a
        due = (a.checkpoint_every and step % a.checkpoint_every == a.checkpoint_every - 1) or \
            (a.checkpoint_every_s and time.monotonic() - (self.saved or self.first) >= a.checkpoint_every_s)
        if due:
            t, (_, delay) = time.monotonic(), schedstat()
            checkpoint(a)
            self.saved, (_, delay_now) = time.monotonic(), schedstat()
            # writing and waiting for the disk; not its wait for a CPU in between (starved, as anywhere)
            counted = max(0.0, self.saved - t - (delay_now - delay))
            self.checkpoint_wall_s += self.saved - t
            self.checkpoint_s += counted
            self.span("checkpoint", t, self.saved, counted)
            self.input_at_save = self.input_s
        self.last, self.delay_last = time.monotonic(), schedstat()[1]

    def line(self) -> str:
        compute = (self.last - self.first) - self.input_s - self.checkpoint_s
        # computing since the last checkpoint ended (since the first step, without one): what a restart loses
        unsaved = self.last - (self.saved or self.first) - (self.input_s - self.input_at_save)
        return (f"startup_s={self.startup_s:.3f} input_s={self.input_s:.3f} checkpoint_s={self.checkpoint_s:.3f} "
                f"compute_s={compute:.3f} unsaved_s={unsaved:.3f} run_delay_s={run_delay_s():.3f} "
                f"main_run_delay_s={schedstat()[1]:.3f} steps_run_delay_s={self.delay_last - self.delay_first:.3f} "
                f"input_wall_s={self.input_wall_s:.3f} checkpoint_wall_s={self.checkpoint_wall_s:.3f}")


def schedstat(path: str = "/proc/thread-self/schedstat") -> tuple[float, float]:
    """Seconds a thread (this one by default) has run, and waited for a CPU (run_delay), so far, by its schedstat;
    0, 0 where the kernel keeps none or the thread has gone (a wait is then counted whole)."""
    try:
        with open(path) as f:
            ran, delay = f.read().split()[:2]
        return int(ran) / 1e9, int(delay) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def run_delay_s() -> float:
    """Seconds this process's threads have waited for a CPU so far, by the kernel's own count (schedstat's
    run_delay; thread-time: with one busy thread, the wall time its steps waited)."""
    import os
    return sum(schedstat(f"/proc/self/task/{tid}/schedstat")[1] for tid in os.listdir("/proc/self/task"))


def own_clock(stdout: str) -> dict[str, float]:
    """This job's own account from its output (its last line: startup_s, input_s, checkpoint_s, …). Run under
    tests/workloads.py `reaped`, whose line follows it, also `run_delay_to_exit_s`: its threads' wait for a CPU to
    the process's last instruction — at its last line, its main thread's wait after it (the teardown), and the
    reaper's own (in the job's group too)."""
    lines = stdout.splitlines()
    own = {k: float(v) for k, v in (w.split("=") for w in [x for x in lines if x.startswith("train: ")][-1].split()
                                    if "=" in w)}
    end = [dict(w.split("=") for w in x.split()[1:]) for x in lines if x.startswith("reaped: ")]
    if end:
        own["run_delay_to_exit_s"] = (own["run_delay_s"] + float(end[-1]["run_delay_s"]) - own["main_run_delay_s"]
                                      + float(end[-1]["self_run_delay_s"]))
    return own


def checkpoint(a) -> None:
    """Write --checkpoint-mib MiB to the checkpoint file and fsync it (what torch.save of a model does, in bulk)."""
    import os
    block = os.urandom(1 << 20)
    path = os.path.join(a.checkpoint_dir, "checkpoint.bin")
    with open(path, "wb") as f:
        for _ in range(a.checkpoint_mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def make_loader(a):
    import torch

    class Synthetic(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return a.steps * a.batch

        def __getitem__(self, i: int):
            if a.stall_every and i % a.batch == 0 and (i // a.batch) % a.stall_every == a.stall_every - 1:
                slow_storage_read(a.stall_s)
            g = torch.Generator().manual_seed(i)
            return torch.randn(3, a.size, a.size, generator=g), i % 10
    return torch.utils.data.DataLoader(Synthetic(), batch_size=a.batch, num_workers=a.loader_workers)


def torch_job(a) -> None:
    import torch
    from torch import nn

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c: int):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                      nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            return torch.relu(x + self.body(x))

    c = a.width
    model = nn.Sequential(nn.Conv2d(3, c, 3, stride=2, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                          *[Block(c) for _ in range(a.blocks)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(c, 10))
    dev = torch.device(a.device)
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if a.loader_workers:
        batches = ((x.to(dev), y.to(dev)) for x, y in make_loader(a))
    else:
        x = torch.randn(a.batch, 3, a.size, a.size, device=dev)
        y = torch.randint(0, 10, (a.batch,), device=dev)
        batches = ((x, y) for _ in range(a.steps))
    clock = a.clock
    clock.first_step()
    step = 0
    while (b := clock.batch(batches)) is not None:
        if a.deadline and time.monotonic() >= a.deadline:
            break
        x, y = b
        a.done = step + 1
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        clock.after_step(step)
        step += 1


def numpy_job(a) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    d = 3 * a.size * a.size
    x = rng.standard_normal((a.batch * 4, d), dtype=np.float32)
    y = rng.integers(0, 10, a.batch * 4)
    w1 = rng.standard_normal((d, a.width * 16), dtype=np.float32) * 0.01
    w2 = rng.standard_normal((a.width * 16, 10), dtype=np.float32) * 0.01
    a.clock.first_step()
    for step in range(a.steps):
        if a.deadline and time.monotonic() >= a.deadline:
            break
        a.done = step + 1
        h = np.maximum(x @ w1, 0)
        logits = h @ w2
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        gw2 = h.T @ p / len(y)
        gh = (p @ w2.T) * (h > 0)
        w1 -= 0.01 * (x.T @ gh / len(y))
        w2 -= 0.01 * gw2
        a.clock.after_step(step)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--numpy", action="store_true", help="use the NumPy stand-in even if PyTorch imports")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (PyTorch only)")
    ap.add_argument("--loader-workers", type=int, default=0, help="batches from a DataLoader with W workers")
    ap.add_argument("--stall-every", type=int, default=0, metavar="N", help="every N-th batch waits (input-bound)")
    ap.add_argument("--stall-s", type=float, default=2.0, metavar="S", help="how long it waits (default 2)")
    ap.add_argument("--seconds", type=float, default=0, metavar="S", help="stop after S seconds if steps remain")
    ap.add_argument("--run-seconds", type=float, default=0, metavar="S",
                    help="stop S seconds after the first step if steps remain")
    ap.add_argument("--startup-s", type=float, default=0, metavar="S", help="wait S seconds before the first step")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="a checkpoint every K steps")
    ap.add_argument("--checkpoint-every-s", type=float, default=0, metavar="S",
                    help="a checkpoint after the step that ends S seconds after the last one (or the first step)")
    ap.add_argument("--checkpoint-mib", type=int, default=64, metavar="M", help="its size (default 64 MiB)")
    ap.add_argument("--checkpoint-dir", default=".", help="where it is written (default: here)")
    ap.add_argument("--timeline", metavar="FILE", help="write each input wait and checkpoint's UNIX times here")
    ap.add_argument("--exit-code", type=int, default=0, metavar="N",
                    help="end with exit code N after its last line (a job that crashed after its last step)")
    a = ap.parse_args(argv)
    a.clock = Clock(a)
    if a.startup_s:
        time.sleep(a.startup_s)          # a model read from slow storage
    if a.stall_every and not a.loader_workers:
        a.loader_workers = 2
    t0 = time.monotonic()
    a.deadline, a.done = (t0 + a.seconds if a.seconds else 0), 0
    framework = "numpy"
    if not a.numpy:
        try:
            import torch  # noqa: F401
            framework = "torch"
        except ImportError:
            pass
    (torch_job if framework == "torch" else numpy_job)(a)
    if framework == "numpy" and a.device != "cpu":
        raise SystemExit(f"--device {a.device} needs PyTorch")
    if a.timeline:
        import json
        c = a.clock
        with open(a.timeline, "w") as f:
            json.dump({"first_step": c.first + c.unix, "last": c.last + c.unix, **c.spans}, f)
    print(f"train: {a.done} steps in {time.monotonic() - t0:.2f} s ({framework}, {a.device}) {a.clock.line()}",
          flush=True)
    if a.exit_code:
        raise SystemExit(a.exit_code)


if __name__ == "__main__":
    main()
