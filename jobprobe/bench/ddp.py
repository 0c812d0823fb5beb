# SPDX-License-Identifier: Apache-2.0
"""A real distributed training job and the cluster that watches it, on one machine: PyTorch DDP (gloo, CPU), one
rank per network namespace, the namespaces joined by veth pairs on a bridge (as nodes on a switch), each rank in its
own cgroup (and, on a hybrid host, its own v1 cpu group, where CPU limits live); one nats-server, one `jobprobe
controller`, one agent per rank. What tests/test_stragglers.py and `jobprobe bench stragglers` run.

The faults a cluster sees, each on one rank: a CPU limit (`throttle`), a slow link (`shape`: tc tbf on its
interface), a lossy link (`lose`: iptables statistic drop at its peers, as this kernel has no netem), a noisy neighbour
(`neighbour`: the rank pinned to a CPU with a hog pinned beside it), a memory limit under its data's page cache
(`squeeze`: v1 memory.limit_in_bytes), throttled reads of data not in memory (`slow_reads`: v1 blkio throttle), a
slow GPU (`slow_gpu`: a fake one, jobprobe/bench/fakegpu.py) and more
work than its peers (`more_work`: a bigger batch, in micro-batches — the job's own imbalance, not a fault of its
node). With `data_mb`, each rank reads `read_mb` of its own data file per step in its training thread (synchronous
data loading), from the page cache while nothing is wrong."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jobprobe.bench.local import Nats, sh, until  # (the tests and the bench take Nats and until from here)
from jobprobe.core.child import stop_child
from jobprobe.kernel.host import find_cgroup_v1_mount
from jobprobe.probes.cgroup import read_kv

REPO = Path(__file__).resolve().parents[2]
PROBES = "cgroup,sched,net,nic,pressure,self"   # each node's agent's (a fake GPU's job adds gpu)
_tags = itertools.count()


class DdpJob:
    def __init__(self, cgroup2: str, world: int = 3, seconds: float = 60, width: int = 384, subnet: str = "10.79.0",
                 batch: int = 256, parent: str = "jobprobe-test", data_mb: int = 0, read_mb: int = 8,
                 disk_mb_s: int = 100, gpu_ms: float = 0):
        """`width`, `batch`: the model's and the step's size — at 384 and 256 a step's compute outweighs its
        all-reduce here, so a rank given more work is seen to be slower (at batch 64 twice the passes hardly
        showed). `parent`: the group the ranks' groups are made in. `data_mb`: each rank's data file (0: none),
        `read_mb` of it read per step, from a disk as fast as `disk_mb_s` (every rank's reads throttled so: this
        VM's disk is the host's page cache, ~500 MB/s, and a rank re-reading its data from it was hardly slower; at
        200 MB/s a rank reading all its data from the disk still made 25 steps/s, the whole job's pace where the
        machine is busy: its memory limit then slowed nothing, and nobody was named).
        `gpu_ms`: each rank waits this long per step for its fake GPU (jobprobe/bench/fakegpu.py; 0: none)."""
        tag = f"{os.getpid() % 10000}x{next(_tags)}"
        self.world, self.seconds, self.width, self.subnet, self.batch = world, seconds, width, subnet, batch
        self.data_mb, self.read_mb, self.disk_bps = data_mb, read_mb, disk_mb_s << 20
        self.data: list[Path] = []
        self.droppers: dict[int, Any] = {}                 # rank → the thread keeping its data out of memory
        self.gpu_ms, self.gpus = gpu_ms, None
        self.bridge = f"jpbr{tag}"
        self.ns = [f"jpd{tag}n{i}" for i in range(world)]
        self.veth = [f"jvd{tag}n{i}" for i in range(world)]          # host side, on the bridge
        self.addr = [f"{subnet}.{i + 1}" for i in range(world)]
        self.cg = [Path(cgroup2, parent, f"ddp-{tag}-rank{i}") for i in range(world)]
        v1 = find_cgroup_v1_mount("/proc/self/mountinfo", "cpu")
        self.v1 = [Path(v1[0], parent, f"ddp-{tag}-rank{i}") for i in range(world)] if v1 else None
        # v1 memory and blkio groups, where those controllers are on v1 (a hybrid host): the ranks join them too
        self.v1x = {c: [Path(m[0], parent, f"ddp-{tag}-rank{i}") for i in range(world)]
                    for c in ("memory", "blkio") if (m := find_cgroup_v1_mount("/proc/self/mountinfo", c))}
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.work: list[Path] = []
        self.hogs: dict[int, subprocess.Popen] = {}       # rank → its noisy neighbour
        self.lossy: dict[int, float] = {}                  # rank → the share of its packets lost
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.ns):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.veth[i], "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", self.veth[i], "master", self.bridge)
            sh("ip", "link", "set", self.veth[i], "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            self.cg[i].mkdir(parents=True)
            for d in self.v1_groups(i):
                d.mkdir(parents=True)

    def v1_groups(self, rank: int) -> list[Path]:
        return ([self.v1[rank]] if self.v1 else []) + [g[rank] for g in self.v1x.values()]

    def start(self, out_dir: Path, port: int = 29511) -> None:
        for i, ns in enumerate(self.ns):
            log = out_dir / f"rank{i}.log"
            self.logs.append(log)
            self.work.append(out_dir / f"rank{i}.work")
            procs = [self.cg[i] / "cgroup.procs"] + [d / "cgroup.procs" for d in self.v1_groups(i)]
            data = []
            if self.data_mb:
                self.data.append(out_dir / f"rank{i}.data")
                with open(self.data[i], "wb") as f:
                    for _ in range(self.data_mb):
                        f.write(os.urandom(1 << 20))
                data = ["--data", str(self.data[i]), "--read-mb", str(self.read_mb)]
                self.slow_reads(i, None)
            if self.gpu_ms:
                data += ["--gpu-ms", str(self.gpu_ms), "--gpu-file", str(self.fake_gpus(out_dir).factor[i])]

            def enter(procs=procs):
                for p in procs:
                    p.write_text(str(os.getpid()))
            self.procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(REPO / "scripts" / "ddp_job.py"), "--rank", str(i),
                 "--world", str(self.world), "--master", f"{self.addr[0]}:{port}", "--seconds", str(self.seconds),
                 "--width", str(self.width), "--batch", str(self.batch), "--ifname", "eth0",
                 "--work", str(self.work[i]), *data],
                preexec_fn=enter, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO))
            if self.gpu_ms:
                self.fake_gpus(out_dir).attach(i, self.procs[i].pid)    # (ip netns exec execs the rank: its pid)

    def fake_gpus(self, out_dir: Path) -> Any:
        """The ranks' fake GPUs (made once, in `out_dir`)."""
        if self.gpus is None:
            from jobprobe.bench.fakegpu import FakeGpus
            self.gpus = FakeGpus(out_dir, self.world)
        return self.gpus

    def agent_env(self, rank: int, out_dir: Path) -> dict[str, str]:
        """What rank's node's agent needs in its environment (its fake GPU, with `gpu_ms`)."""
        return self.fake_gpus(out_dir).env(rank) if self.gpu_ms else {}

    def slow_gpu(self, rank: int, on: bool) -> None:
        """rank's GPU at half its clock (its per-step wait doubled), its NVML saying so; off: back to full."""
        self.gpus.slow(rank, on)

    def limit_dir(self, rank: int) -> Path:
        """Where rank's CPU limit is set: its cgroup2 group when the cpu controller is on there, else v1."""
        ctl = self.cg[rank].parent / "cgroup.subtree_control"
        if ctl.exists() and "cpu" in ctl.read_text().split():
            return self.cg[rank]
        assert self.v1, "no cpu controller on cgroup2 or v1"
        return self.v1[rank]

    def throttle(self, rank: int, cores: float | None) -> None:
        """Limit rank's CPU to `cores` (None: no limit)."""
        d = self.limit_dir(rank)
        if d == self.cg[rank]:
            (d / "cpu.max").write_text(f"{int(cores * 100000)} 100000\n" if cores else "max 100000\n")
        else:
            (d / "cpu.cfs_period_us").write_text("100000\n")
            (d / "cpu.cfs_quota_us").write_text(f"{int(cores * 100000)}\n" if cores else "-1\n")

    def shape(self, rank: int, rate: str | None) -> None:
        """Shape what rank sends (tc tbf on its eth0) to `rate` (e.g. "20mbit"); None removes it."""
        if rate:
            sh("ip", "netns", "exec", self.ns[rank], "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
               "rate", rate, "burst", "16kb", "latency", "20ms")
        else:
            subprocess.run(["ip", "netns", "exec", self.ns[rank], "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True)

    def lose(self, rank: int, share: float | None) -> None:
        """Lose `share` of the packets rank sends on its link (None: no more): dropped as they arrive at its peers
        (iptables statistic in their namespaces' INPUT). A drop on rank's own way out (its OUTPUT chain, its
        qdisc) is no loss to TCP — the stack is told and sends again later, no retransmit — so the drop is where
        a lossy link would lose them: past the sender."""
        for peer in range(self.world):
            if peer == rank:
                continue
            spec = ["INPUT", "-s", self.addr[rank], "-m", "statistic", "--mode", "random", "--probability",
                    f"{share or self.lossy.get(rank, 0):g}", "-j", "DROP"]
            if share and rank not in self.lossy:
                sh("ip", "netns", "exec", self.ns[peer], "iptables", "-A", *spec)
            elif not share and rank in self.lossy:
                sh("ip", "netns", "exec", self.ns[peer], "iptables", "-D", *spec)
        if share and rank not in self.lossy:
            self.lossy[rank] = share
        elif not share:
            self.lossy.pop(rank, None)

    def neighbour(self, rank: int, on: bool, cpu: int = 1) -> None:
        """A noisy neighbour: rank's threads pinned to `cpu` and a CPU hog outside the job pinned beside them (at
        nice -5: it weighs 3x the rank, which gets a quarter of that CPU), the other ranks kept to the other CPUs —
        on separate nodes a neighbour takes nothing from the others; here, unpinned, they would crowd onto the CPUs
        left and be slowed nearly as much. Off: the hog gone, every rank free to run anywhere again."""
        every = set(range(os.cpu_count() or 1))
        if on and rank not in self.hogs:
            self.hogs[rank] = subprocess.Popen(
                [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\nos.nice(-5)\nwhile True: pass" % cpu])
            for r in range(self.world):
                self.pin(r, {cpu} if r == rank else (every - {cpu}) or every)
        elif not on and rank in self.hogs:
            hog = self.hogs.pop(rank)
            hog.kill()
            hog.wait()
            for r in range(self.world):
                self.pin(r, every)

    def squeeze(self, rank: int, on: bool, headroom_mb: int = 64) -> None:
        """A memory limit under rank's data (v1 memory.limit_in_bytes: its anonymous memory + `headroom_mb`), its
        data's pages dropped first so that its reads bring them back charged to it: each pass over the data then
        reclaims its own page cache and reads again. Off: no limit."""
        d = self.v1x["memory"][rank]
        if on:
            rss = read_kv(str(d / "memory.stat"))["total_rss"]
            self.drop(rank)
            (d / "memory.limit_in_bytes").write_text(f"{rss + (headroom_mb << 20)}\n")
        else:
            (d / "memory.limit_in_bytes").write_text("-1\n")

    def slow_reads(self, rank: int, bps: int | None) -> None:
        """rank's reads from its data's disk throttled to `bps` bytes/s (v1 blkio.throttle.read_bps_device), and its
        data kept out of memory while so (dropped every 0.5 s: a data set larger than the page cache); None: back
        to the disk's usual speed, the data cached again as it is read."""
        import threading
        st = os.stat(self.data[rank])
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        part = Path(f"/sys/dev/block/{dev}")
        if (part / "partition").exists():          # the throttle is the whole disk's
            dev = (part.resolve().parent / "dev").read_text().strip()
        (self.v1x["blkio"][rank] / "blkio.throttle.read_bps_device").write_text(f"{dev} {bps or self.disk_bps}\n")
        if bps and rank not in self.droppers:
            stop = threading.Event()

            def dropping() -> None:
                while not stop.wait(0.5):
                    self.drop(rank)
            t = threading.Thread(target=dropping, daemon=True)
            t.start()
            self.drop(rank)
            self.droppers[rank] = (t, stop)
        elif not bps and rank in self.droppers:
            t, stop = self.droppers.pop(rank)
            stop.set()
            t.join()

    def drop(self, rank: int) -> None:
        """rank's data file out of the page cache (what it reads next comes from the disk)."""
        fd = os.open(self.data[rank], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def pin(self, rank: int, cpus: set[int]) -> None:
        for pid in (self.cg[rank] / "cgroup.procs").read_text().split():
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:           # a thread that just ended
                    pass

    def more_work(self, rank: int, factor: float | None) -> None:
        """Give rank `factor` times the work of the others per step (read by it within 20 steps: as many forward and
        backward passes, as micro-batches of a bigger batch); None: back to 1."""
        self.work[rank].write_text(f"{factor or 1.0:g}\n")

    def tc_stats(self, rank: int) -> dict[str, int]:
        """rank's eth0 root qdisc, as `tc -s qdisc` prints it."""
        import re
        out = sh("ip", "netns", "exec", self.ns[rank], "tc", "-s", "qdisc", "show", "dev", "eth0")
        m = re.search(r"dropped (\d+), overlimits (\d+) requeues (\d+)", out)
        return {"drops": int(m[1]), "overlimits": int(m[2]), "requeues": int(m[3])} if m else {}

    def rates(self, rank: int) -> list[float]:
        """rank's steps/s as it printed them, in order."""
        out = []
        for line in self.logs[rank].read_text().splitlines():
            if "steps/s" in line:
                out.append(float(line.rsplit(":", 1)[1].split()[0]))
        return out

    def blocked(self, rank: int) -> list[tuple[float, float]]:
        """rank's own clock of its main thread's time blocked in collectives: (UNIX time, seconds so far) per print."""
        return [(t, b) for t, _, b in self._progress(rank)]

    def steps(self, rank: int) -> list[tuple[float, float]]:
        """rank's steps done: (UNIX time, steps so far) per print."""
        return [(t, k) for t, k, _ in self._progress(rank)]

    def _progress(self, rank: int) -> list[tuple[float, float, float]]:
        from jobprobe.bench.ddpclock import progress
        return progress(self.logs[rank])

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def close(self) -> None:
        for rank in list(self.hogs):
            self.neighbour(rank, False)
        for rank in list(self.droppers):
            self.slow_reads(rank, None)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        groups = self.cg + [g for i in range(self.world) for g in self.v1_groups(i)]
        for d in groups:
            for _ in range(50):
                try:
                    for pid in (d / "cgroup.procs").read_text().split():
                        os.kill(int(pid), 9)
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        for d in {d.parent for d in groups}:
            try:
                d.rmdir()            # the parent, once nothing else is in it (the tests' is shared: it stays)
            except OSError:
                pass
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Cluster:
    """One NATS server, one `jobprobe controller` (or one per partition, `partitions`: the server maps each job's
    frames to its partition), one agent per rank (each its own node name), attached to the ranks' cgroups as job
    `job` — what a real cluster runs, on one machine. `store`: the job's partition's store; `controller_args` go to
    its controller."""

    def __init__(self, tmp: Path, ddp: DdpJob, job: str = "ddp", probes: str = PROBES,
                 controller_args: tuple[str, ...] = (), partitions: int = 1):
        from jobprobe.core.wire import job_token, mappings_conf, partition
        self.tmp, self.ddp, self.job, self.probes = tmp, ddp, job, probes
        self.nats = Nats(tmp)
        self.nats.start(mappings_conf(partitions))
        mine = partition(job_token(job), partitions)
        self.stores = [tmp / ("store.db" if partitions == 1 else f"p{i}.db") for i in range(partitions)]
        self.store = self.stores[mine]
        self.controllers = [subprocess.Popen(
            [sys.executable, "-m", "jobprobe.cli", "controller", "--nats", self.nats.url, "--store", str(store),
             "--partition", f"{i}/{partitions}", *(controller_args if i == mine else ())], cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=open(tmp / f"controller{'' if partitions == 1 else i}.log", "ab"))
            for i, store in enumerate(self.stores)]
        self.controller = self.controllers[mine]
        self.agents: list[subprocess.Popen] = []
        self.nodes = [f"node-{chr(ord('a') + i)}" for i in range(ddp.world)]

    def start_agents(self) -> None:
        for i, node in enumerate(self.nodes):
            d = self.tmp / node
            d.mkdir(exist_ok=True)
            self.agents.append(subprocess.Popen(
                [sys.executable, "-m", "jobprobe.cli", "agent", "--node", node, "--send", self.nats.url,
                 "--spool", str(d / "spool"), "--socket", str(d / "agent.sock"), "--state", str(d / "jobs.json"),
                 "--out", str(d / "out"), "--probes", self.probes, "--interval", "1"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(d / "agent.log", "ab"),
                env={**os.environ, **self.ddp.agent_env(i, self.tmp)}))

    def attach(self) -> None:
        from jobprobe.node.control import call

        for i, node in enumerate(self.nodes):
            sock = str(self.tmp / node / "agent.sock")

            def up():
                try:
                    return call(sock, {"cmd": "status"})
                except Exception:
                    return None
            until(up, 120, f"agent {node}")
            r = call(sock, {"cmd": "attach", "cgroup": str(self.ddp.cg[i]), "job": self.job})
            assert r["ok"], r

    def events(self, name: str | None = None) -> list[dict]:
        import json
        import sqlite3
        if not self.store.exists():
            return []
        db = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT body FROM events WHERE job = ? ORDER BY t", (self.job,)).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            db.close()
        out = [json.loads(b) for (b,) in rows]
        return [e for e in out if name is None or e["event"] == name]

    def samples(self) -> list[tuple[str, float, float, dict]]:
        import json
        import sqlite3
        db = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT node, t, dt, body FROM samples WHERE job = ? ORDER BY t", (self.job,)).fetchall()
        finally:
            db.close()
        return [(n, t, dt, json.loads(b)["probes"]) for n, t, dt, b in rows]

    def close(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.terminate()
        for p in self.agents:
            stop_child(p, 30)
        for c in self.controllers:
            stop_child(c, 30)
        self.nats.stop()


def demo(out: Path, cores: float = 0.25) -> int:
    """`make demo`'s last act: the DDP job on three namespace nodes, agents → NATS → controller, in step for 15 s,
    then rank 1's CPU limited to `cores` mid-run — ends when the controller names the straggler (or after 60 s),
    with the job's summary 10 s later: where its time went, the straggler, the node-seconds the others waited."""
    from jobprobe.kernel.host import find_cgroup2_mount
    out.mkdir(parents=True, exist_ok=True)
    ddp = DdpJob(find_cgroup2_mount() or "/sys/fs/cgroup", seconds=600, parent="jobprobe-demo")
    cluster = Cluster(out, ddp)
    try:
        cluster.start_agents()
        ddp.start(out)
        cluster.attach()
        until(lambda: len(ddp.rates(0)) >= 3, 120, "the job to train")
        print(f"the job trains: {ddp.rates(0)[-1]:.0f} steps/s on 3 ranks (nodes {', '.join(cluster.nodes)})",
              flush=True)
        time.sleep(15)
        t0 = time.time()
        ddp.throttle(1, cores)
        print(f"rank 1 (node-b) limited to {cores:g} CPU cores", flush=True)
        e = until(lambda: [x for x in cluster.events() if x["event"] in ("straggler", "imbalance")], 60,
                  "the controller to name the straggler")[0]
        print(f"after {time.time() - t0:.1f} s, the job at {ddp.rates(0)[-1]:.0f} steps/s, the controller says: "
              f"{e['reason']} (waited for by {', '.join(e['waited_by']) or 'nobody'})", flush=True)
        time.sleep(10)
        from jobprobe.cluster import summary
        print(f"\n== jobprobe summary --store {cluster.store} --job {cluster.job} (the run so far)", flush=True)
        print(summary.text(summary.summarize(summary.frames_of_store(str(cluster.store), cluster.job), cluster.job)),
              end="", flush=True)
        return 0
    finally:
        cluster.close()
        ddp.close()


if __name__ == "__main__":
    sys.exit(demo(Path(sys.argv[1] if len(sys.argv) > 1 else "out/stragglers")))
