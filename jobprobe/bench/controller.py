# SPDX-License-Identifier: Apache-2.0
"""`jobprobe bench controller`: what one controller keeps up with, and what a node sends.

- A real nats-server with JetStream and a real `jobprobe controller` (processes of their own), fed by simulated
  nodes: frames the size of real ones (a real agent's standard-collection sample on this machine, re-stamped per
  node and tick), published at 1 frame per node per interval by a generator process (asyncio, several connections).
- Keeps up: at N nodes for a while, the frames stored per second against the frames published per second, the
  backlog at the end (published but not yet stored), and the controller's CPU in cores.
- Ceiling: as many frames as the generator can publish, as fast as it can; the controller's stored frames per
  second and per core of its own CPU.
- A node's bytes on the wire per interval: the frame, its subject and its headers as NATS carries them.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib
from pathlib import Path

from jobprobe.bench.overhead import free_port, scratch
from jobprobe.core.child import stop_child
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.core.wire import subject_of

# A standard-collection sample as this machine's agent writes it (cgroup, sched, perf, blockio, net, pressure, self;
# gpu unavailable here): the shape and size a node sends. Values are re-stamped per frame.
PROBES = {
    "cgroup": {"cpu_user_ns": 812000000, "cpu_system_ns": 23000000, "mem_bytes": 1851392000,
               "mem_peak_bytes": 1923481600, "mem_anon_bytes": 1700000000, "mem_file_bytes": 151392000,
               "io_read_bytes": 40960, "io_write_bytes": 1048576, "nprocs": 9},
    "sched": {"voluntary_switches": 4120, "involuntary_switches": 311, "offcpu_preempt_ns": 10411000,
              "offcpu_io_ns": 1203000, "offcpu_lock_ns": 30212000, "offcpu_sleep_ns": 120300000,
              "offcpu_wait_ns": 402000000, "wakeup_ns": 2301000, "runq_ns": 8120000, "runq_events": 4431,
              "runq_lat_us_log2": [0, 12, 380, 2400, 1200, 300, 80, 40, 10, 5, 3, 1] + [0] * 15,
              "runq_lat_p50_us": 9.4, "runq_lat_p99_us": 210.0, "bpf_missed": 0},
    "perf": {"task_clock_ns": 835000000, "context_switches": 4431, "cpu_migrations": 20, "page_faults": 1200,
             "major_faults": 0, "cycles": None, "instructions": None, "ipc": None},
    "blockio": {"read_requests": 10, "read_bytes": 40960, "read_lat_us_log2": [0] * 6 + [4, 5, 1] + [0] * 18,
                "read_lat_p50_us": 96.0, "read_lat_p99_us": 480.0, "write_requests": 12, "write_bytes": 1048576,
                "write_lat_us_log2": [0] * 7 + [6, 5, 1] + [0] * 17, "write_lat_p50_us": 180.0,
                "write_lat_p99_us": 900.0, "inflight_expired": 0, "bpf_missed": 0},
    "net": {"tcp_tx_bytes": 51234567, "tcp_rx_bytes": 50123456, "tcp_tx_segs": 36000, "tcp_rx_segs": 35000,
            "udp_tx_bytes": 0, "udp_rx_bytes": 1200, "retransmits": 2, "tcp_opens": 0, "tcp_closes": 0,
            "top_peers": [{"addr": "10.0.3.12", "port": 29500, "tx_bytes": 25000000, "rx_bytes": 24000000},
                          {"addr": "10.0.3.13", "port": 29500, "tx_bytes": 26000000, "rx_bytes": 26000000}],
            "source": "skb", "bpf_missed": 0},
    "pressure": {"cpu_some_ns": 2103000, "cpu_full_ns": 0, "mem_some_ns": 0, "mem_full_ns": 0, "io_some_ns": 120000,
                 "io_full_ns": 80000, "irq_full_ns": None},
    "self": {"cpu_ns": 2100000, "cpu_cores": 0.0021, "rss_bytes": 31000000, "rss_peak_bytes": 33000000,
             "written_bytes": 1800, "sink_dropped": 0, "sink_errors": 0, "sink_queue_max": 0,
             "sinks": [{"name": "nats:nats://10.0.0.1:4222", "dropped": 0, "errors": 0, "depth": 0, "state": "ok"}]},
}
STATUS = {name: "ok" for name in PROBES}

GENERATOR = r"""
import asyncio, json, sys, time, zlib
import nats
sys.path.insert(0, sys.argv[1])
from jobprobe.core.frame import FrameBuilder, encode
from jobprobe.bench.controller import PROBES, STATUS
from jobprobe.core.wire import subject_of
url, nodes, seconds, rate, conns, ticks, run = (sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]),
                                               int(sys.argv[6]), int(sys.argv[7]), sys.argv[8])
creds = sys.argv[9] if len(sys.argv) > 9 and sys.argv[9] else None
sizes = [int(x) for x in sys.argv[10].split(",")] if len(sys.argv) > 10 else None
def job_of(i):   # jobs of the given sizes in turn (nodes 0..7 the first job of 8, …), else 97 jobs round robin
    if not sizes:
        return f"job{i % 97}"
    k = start = 0
    while start + sizes[k % len(sizes)] <= i:
        start += sizes[k % len(sizes)]
        k += 1
    return f"job{k}"
async def main():
    ncs = [await nats.connect(url, **({"nkeys_seed": creds} if creds else {})) for _ in range(conns)]
    jss = [nc.jetstream() for nc in ncs]
    builders = [FrameBuilder(f"sim{i:05d}", job_of(i), run=run) for i in range(nodes)]
    sent = 0
    t0 = time.monotonic()
    tick = 0
    while time.monotonic() - t0 < seconds and (ticks <= 0 or tick < ticks):
        futs = []
        for i, b in enumerate(builders):
            f = b.sample(time.time(), 1.0, PROBES, STATUS)
            data = zlib.compress(encode(f), 6)     # as agents send them
            js = jss[i % conns]
            futs.append(js.publish(subject_of(f), data,
                                   headers={"Nats-Msg-Id": f"{f['node']}/{f['job']}/{run}/{f['seq']}"}, timeout=30))
            if len(futs) >= 500:
                await asyncio.gather(*futs)
                sent += len(futs)
                futs = []
        await asyncio.gather(*futs)
        sent += len(futs)
        tick += 1
        if rate > 0:   # one frame per node per 1/rate s
            await asyncio.sleep(max(0.0, t0 + tick / rate - time.monotonic()))
    print(json.dumps({"sent": sent, "seconds": time.monotonic() - t0}), flush=True)
    for nc in ncs:
        await nc.close()
asyncio.run(main())
"""


def frame_wire_bytes() -> dict:
    """A standard sample's size: msgpack bytes, and as NATS carries it (HPUB line, headers, payload)."""
    f = FrameBuilder("node-0001", "job-12345", run="0123456789abcdef").sample(time.time(), 1.0, PROBES, STATUS)
    plain = encode(f)
    data = zlib.compress(plain, 6)       # as the agent sends it
    subject = subject_of(f)
    headers = f"NATS/1.0\r\nNats-Msg-Id: {f['node']}/{f['job']}/{f['run']}/{f['seq']}\r\n\r\n"
    line = f"HPUB {subject} _INBOX.abcdefghijklmnopqrstuv.12345678 {len(headers)} {len(headers) + len(data)}\r\n"
    ack = 60   # the PubAck back: {"stream":"JOBPROBE","seq":N} and its MSG line
    return {"frame_bytes": len(plain), "compressed_bytes": len(data),
            "wire_bytes": len(line) + len(headers) + len(data) + 2 + ack}


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def stored(store: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT frames FROM (SELECT SUM(frames) AS frames FROM delivery)").fetchone()[0] or 0
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def bench_controller(nodes: int = 2000, seconds: float = 30.0, burst_frames: int = 60_000, progress=None) -> dict:
    """Its nats-server's data and the controller's store go to a scratch directory, removed at the end."""
    with scratch(None, "jobprobe-bench-ctl-") as work:
        return _bench_controller(nodes, seconds, burst_frames, progress, work)


def _bench_controller(nodes: int, seconds: float, burst_frames: int, progress, work: Path) -> dict:
    from jobprobe.cluster.natsserver import LocalNats
    say = (lambda s: (progress.write(s + "\n"), progress.flush())) if progress else (lambda s: None)
    root = str(Path(__file__).resolve().parents[2])
    nats_srv = LocalNats(work, f"127.0.0.1:{free_port()}")
    nats_srv.wait()
    res: dict = {"nodes": nodes, **frame_wire_bytes()}
    ctl = None
    try:
        store = work / "store.db"

        def start_controller() -> subprocess.Popen:
            p = subprocess.Popen([sys.executable, "-m", "jobprobe.cli", "controller", "--nats", nats_srv.url,
                                  "--creds", nats_srv.creds, "--store", str(store)], cwd=root,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2.0)
            return p
        ctl = start_controller()

        def generate(n: int, secs: float, rate: float, conns: int, ticks: int = 0) -> dict:
            # each phase its own run id: its frames' keys (and Nats-Msg-Ids) are new ones
            out = subprocess.run([sys.executable, "-c", GENERATOR, root, nats_srv.url, str(n), str(secs), str(rate),
                                  str(conns), str(ticks), os.urandom(8).hex(), nats_srv.creds],
                                 capture_output=True, text=True, timeout=secs * 10 + 600)
            if out.returncode != 0:
                raise RuntimeError(f"generator: {out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        # keeps up: nodes frames per second for `seconds`
        n0, c0, t0 = stored(store), cpu_s(ctl.pid), time.monotonic()
        gen = generate(nodes, seconds, 1.0, 4)
        t1 = time.monotonic()
        n1, c1 = stored(store), cpu_s(ctl.pid)
        end = time.monotonic() + 120
        while stored(store) - n0 < gen["sent"] and time.monotonic() < end:
            time.sleep(0.2)
        drained = time.monotonic() - t1
        res["keep_up"] = {"published_per_s": round(gen["sent"] / gen["seconds"], 1),
                          "stored_per_s": round((n1 - n0) / (t1 - t0), 1),
                          "backlog_at_end": gen["sent"] - (n1 - n0), "drained_after_s": round(drained, 2),
                          "all_stored": stored(store) - n0 == gen["sent"],
                          "controller_cores": round((c1 - c0) / (t1 - t0), 3)}
        say(f"{nodes} nodes: {res['keep_up']}")
        # ceiling: the controller stopped, a backlog published as fast as the generator can; then the controller
        # started again and timed until it has stored the backlog (its own CPU over that time)
        ctl.send_signal(signal.SIGTERM)
        ctl.wait(timeout=60)
        n0 = stored(store)
        gen = generate(max(1, burst_frames // 20), 600.0, 1000.0, 4, ticks=20)
        t0 = time.monotonic()          # from its start: it drains part of the backlog while it settles
        ctl = start_controller()
        c0 = 0.0                       # a new process: all its CPU is this phase's
        end = time.monotonic() + 600
        while stored(store) - n0 < gen["sent"] and time.monotonic() < end:
            time.sleep(0.2)
        t1 = time.monotonic()
        n1, c1 = stored(store), cpu_s(ctl.pid)
        res["ceiling"] = {"frames": n1 - n0, "backlog": gen["sent"], "seconds": round(t1 - t0, 2),
                          "frames_per_s": round((n1 - n0) / (t1 - t0), 1), "controller_cpu_s": round(c1 - c0, 2),
                          "frames_per_core_s": round((n1 - n0) / max(1e-9, c1 - c0), 1)}
        say(f"ceiling: {res['ceiling']}")
    finally:
        if ctl is not None:
            stop_child(ctl, 30)
        nats_srv.stop()
    return res


def markdown(res: dict) -> str:
    k, c = res.get("keep_up", {}), res.get("ceiling", {})
    return "\n".join([
        "| | |", "| - | - |",
        f"| standard sample | {res['frame_bytes']} B msgpack, {res['compressed_bytes']} B compressed, "
        f"{res['wire_bytes']} B on the wire with subject, headers and ack: {res['wire_bytes'] / 1024:.2f} KiB/s per "
        f"node at 1 s |",
        f"| {res['nodes']} simulated nodes at 1 s | published {k.get('published_per_s')} frames/s, stored "
        f"{k.get('stored_per_s')}/s, backlog at the end {k.get('backlog_at_end')} "
        f"(drained {k.get('drained_after_s')} s "
        f"later), all stored: {k.get('all_stored')}; controller {k.get('controller_cores')} cores |",
        f"| ceiling (a backlog of {c.get('backlog')} frames drained) | {c.get('frames')} frames in "
        f"{c.get('seconds')} s:"
        f" {c.get('frames_per_s')} frames/s; {c.get('frames_per_core_s')} frames per second of controller CPU |",
    ])
