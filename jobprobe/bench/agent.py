# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench agent`: what the node agent costs as jobs are added — a real `jobprobe agent` process with N
jobs attached over its control socket.

- Kernel cost per event, flat in the number of jobs: with 1, 16 and 64 jobs attached (each an idle process in a
  group of its own, the micro-workload in one more), the ns per run of every program the agent holds, measured by
  the kernel (bpf_stats) over one run of the pingpong micro-workload; bcc's runqlat beside it in the same run.
- The agent with 64 idle jobs at 1 s: its CPU (utime + stime of the agent process over a window, in cores) and
  steady RSS.
- Attach to first frame: from the attach request to the job's first sample frame in its file.
- Leaks: attach/detach cycles, then the agent's fds and the programs it holds, against where they started.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jobprobe.bench.events import program_stats, run_workload
from jobprobe.bench.overhead import _rmdir, scratch
from jobprobe.core.child import stop_child
from jobprobe.core.errors import BadInput
from jobprobe.core.frame import StreamReader
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import procfs
from jobprobe.kernel.host import find_cgroup2_mount
from jobprobe.node.control import call


def held_programs(pid: int) -> set[int]:
    ids = set()
    base = Path(f"/proc/{pid}/fdinfo")
    for fd in os.listdir(base):
        try:
            for line in (base / fd).read_text().splitlines():
                if line.startswith("prog_id:"):
                    ids.add(int(line.split()[1]))
        except OSError:
            pass
    return ids


def cpu_s(pid: int) -> float:
    st = procfs.read_stat("/proc", pid)
    return 0.0 if st is None else (st.utime + st.stime) / procfs.CLK_TCK


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class JobGroups:
    """cgroup2 groups of their own under `base`, each with one process started in it (a bench's jobs); close()
    kills the processes and removes the groups, and `base`."""

    def __init__(self, base: Path):
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        self.jobs: dict[Path, subprocess.Popen] = {}

    def add(self, name: str, argv: list[str]) -> Path:
        g = self.base / name
        g.mkdir(exist_ok=True)
        tasks = g / "cgroup.procs"
        self.jobs[g] = subprocess.Popen(argv, preexec_fn=lambda: tasks.write_text(str(os.getpid())),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return g

    def remove(self, groups: list[Path]) -> None:
        for g in groups:
            proc = self.jobs.pop(g, None)
            if proc is not None:
                proc.kill()
                proc.wait()
            _rmdir(g)

    def close(self) -> None:
        self.remove(list(self.jobs))
        _rmdir(self.base)


class AgentUnderTest:
    def __init__(self, work: Path, probes: str, interval: float, extra: list[str] | None = None):
        self.work, self.sock = work, str(work / "agent.sock")
        self.out = work / "out"
        self.proc = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "agent", "--socket", self.sock,
                                      "--state", str(work / "jobs.json"), "--out", str(self.out), "--interval",
                                      str(interval), "--probes", probes] + list(extra or []),
                                     stdin=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise BadInput("jobprobe agent exited at start")
            try:
                call(self.sock, {"cmd": "status"})
                return
            except BadInput:
                time.sleep(0.05)
        raise BadInput("jobprobe agent did not start within 60 s")

    def ctl(self, **req) -> dict:
        r = call(self.sock, req, timeout=60)
        if not r.get("ok"):
            raise BadInput(f"agent: {r.get('error')}")
        return r

    def close(self) -> None:
        stop_child(self.proc, 60)


def per_program(pids: list[int], group: Path, n: int) -> dict[str, dict]:
    """ns per run of the programs these processes hold, over one pingpong run in `group` (bpf_stats)."""
    ids = set().union(*(held_programs(p) for p in pids))
    with _bpf.stats_enabled():
        start = {i: v for i, v in program_stats().items() if i in ids}
        run_workload("pingpong", n, group)
        end = program_stats()
    out = {}
    for i, (name, t0, c0) in start.items():
        if i in end and end[i][2] > c0:
            out[name] = {"ns_per_run": round((end[i][1] - t0) / (end[i][2] - c0), 1), "runs": end[i][2] - c0}
    return out


def bench_agent(counts: tuple[int, ...] = (1, 16, 64), n: int = 50_000, idle_s: float = 30.0, cycles: int = 1000,
                probes: str = "std", peer: bool = True, progress=None, nats: bool = False) -> dict:
    """`nats`: the agent also sends every frame to a local nats-server, consumed by a real controller (its CPU and
    RSS then include the NATS sink and its spool). Its files (frames, spool, store) go to a scratch directory,
    removed at the end."""
    mount = find_cgroup2_mount()
    if mount is None:
        raise BadInput("no cgroup2 hierarchy mounted")
    with scratch(None, "jobprobe-bench-agent-") as work:
        return _bench_agent(counts, n, idle_s, cycles, probes, peer, progress, nats, work, Path(mount))


def _bench_agent(counts: tuple[int, ...], n: int, idle_s: float, cycles: int, probes: str, peer: bool, progress,
                 nats: bool, work: Path, mount: Path) -> dict:
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    jobs = JobGroups(Path(mount, "jobprobe-bench", f"agent-{os.getpid()}"))

    def idle_job(i: int) -> Path:
        return jobs.add(f"idle-{i}", ["sleep", "100000"])

    result: dict = {"probes": probes, "n": n, "per_event": {}, "cycles": cycles}
    extra: list[str] = []
    local = controller = None
    if nats:
        from jobprobe.bench.overhead import free_port
        from jobprobe.cluster.natsserver import LocalNats
        local = LocalNats(work / "nats", f"127.0.0.1:{free_port()}")
        local.wait()
        controller = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "controller", "--nats", local.url,
                                       "--store", str(work / "store.db")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        extra = ["--send", local.url, "--spool", str(work / "spool")]
        result["nats"] = True
    work_group = jobs.base / "workload"
    agent = AgentUnderTest(work, probes, 1.0, extra)
    peer_proc = None
    try:
        if peer and shutil.which("runqlat-bpfcc"):
            peer_proc = subprocess.Popen(["runqlat-bpfcc", "3600", "1"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL)
            peer_proc.stdout.readline()          # "Tracing ..." once attached
        work_group.mkdir(exist_ok=True)
        idle = [idle_job(i) for i in range(max(5, max(counts) - 1))]
        # attach to first frame, on a fresh job each time
        latencies = []
        for i in range(5):
            t0 = time.monotonic()
            agent.ctl(cmd="attach", cgroup=str(idle[i]), job=f"first-{i}")
            path = agent.out / f"first-{i}.mpk"
            while True:
                try:
                    with open(path, "rb") as f:
                        if any(fr["kind"] == "sample" for fr in StreamReader(f)):
                            break
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)
            latencies.append(time.monotonic() - t0)
            agent.ctl(cmd="detach", job=f"first-{i}")
        result["attach_to_first_sample_s"] = {"max": round(max(latencies), 3), "all": [round(x, 3) for x in latencies]}
        for count in counts:
            agent.ctl(cmd="attach", cgroup=str(work_group), job="workload")
            for i in range(count - 1):
                agent.ctl(cmd="attach", cgroup=str(idle[i]), job=f"idle-{i}")
            time.sleep(1.5)
            pids = [agent.proc.pid] + ([peer_proc.pid] if peer_proc else [])
            result["per_event"][count] = per_program(pids, work_group, n)
            say(f"{count} jobs: " + ", ".join(f"{k} {v['ns_per_run']:.0f} ns" for k, v in
                                               result["per_event"][count].items()))
            if count == max(counts):
                c0, t0 = cpu_s(agent.proc.pid), time.monotonic()
                time.sleep(idle_s)
                cores = (cpu_s(agent.proc.pid) - c0) / (time.monotonic() - t0)
                result["idle"] = {"jobs": count, "cores": round(cores, 5), "rss_bytes": rss(agent.proc.pid),
                                  "seconds": idle_s}
                say(f"{count} idle jobs: {cores:.4f} cores, {rss(agent.proc.pid) / 2**20:.1f} MiB")
            try:
                agent.ctl(cmd="detach", job="workload")
            except BadInput:
                pass                              # its processes are gone: the agent detached it by itself
            for i in range(count - 1):
                agent.ctl(cmd="detach", job=f"idle-{i}")
        # leaks
        agent.ctl(cmd="attach", cgroup=str(idle[0]), job="warm")
        agent.ctl(cmd="detach", job="warm")
        fds0, progs0 = len(os.listdir(f"/proc/{agent.proc.pid}/fd")), len(held_programs(agent.proc.pid))
        t0 = time.monotonic()
        for i in range(cycles):
            agent.ctl(cmd="attach", cgroup=str(idle[0]), job=f"cycle-{i}")
            agent.ctl(cmd="detach", job=f"cycle-{i}")
        fds1, progs1 = len(os.listdir(f"/proc/{agent.proc.pid}/fd")), len(held_programs(agent.proc.pid))
        result["leaks"] = {"fds": [fds0, fds1], "programs": [progs0, progs1],
                           "seconds_per_cycle": round((time.monotonic() - t0) / max(1, cycles), 4)}
        say(f"{cycles} cycles: fds {fds0} -> {fds1}, programs {progs0} -> {progs1}")
    finally:
        agent.close()
        if controller is not None:
            stop_child(controller, 30)
        if local is not None:
            local.stop()
        if peer_proc is not None:
            stop_child(peer_proc, 30)
        _rmdir(work_group)
        jobs.close()
    return result


def markdown(res: dict) -> str:
    names = sorted({k for per in res["per_event"].values() for k in per})
    lines = [f"Probes `{res['probes']}`; pingpong micro-workload, {res['n']} round trips; ns per program run "
             f"(bpf_stats), the agent holding 1 program set for every job:", "",
             "| Program | " + " | ".join(f"{c} job(s)" for c in res["per_event"]) + " |",
             "| - |" + " - |" * len(res["per_event"])]
    for name in names:
        lines.append(f"| `{name}` | " + " | ".join(
            f"{per[name]['ns_per_run']:.0f}" if name in per else "—" for per in res["per_event"].values()) + " |")
    if "idle" in res:
        i = res["idle"]
        lines += ["", f"Agent with {i['jobs']} idle jobs at 1 s: {i['cores']:.4f} cores over {i['seconds']:.0f} s, "
                      f"RSS {i['rss_bytes'] / 2**20:.1f} MiB."]
    a = res["attach_to_first_sample_s"]
    lines.append(f"Attach to the first sample frame: {a['max']:.2f} s at most ({', '.join(map(str, a['all']))}).")
    lk = res["leaks"]
    lines.append(f"{res['cycles']} attach/detach cycles ({lk['seconds_per_cycle'] * 1000:.1f} ms each): agent fds "
                 f"{lk['fds'][0]} → {lk['fds'][1]}, programs held {lk['programs'][0]} → {lk['programs'][1]}.")
    return "\n".join(lines)
