"""jobprobe's command line: run (attach and sample one job), agent (the node daemon) and its clients attach, detach,
status and probes --job, probes (what can run here), read (decode a frame file), bench.

Bad input gets one line on stderr and exit code 2; nothing deeper than this module exits the process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time

from jobprobe import __version__
from jobprobe.core.errors import BadInput, JobprobeError
from jobprobe.core.frame import MalformedFrame, StreamReader
from jobprobe.kernel.host import Host

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, not usage + error
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="jobprobe", description="Per-job probes for training clusters: one frame per job per tick.")
    p.add_argument("--version", action="version", version=f"jobprobe {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)

    r = sub.add_parser("run", help="attach to a job and sample it every interval",
                       usage="jobprobe run (--cgroup PATH | --pid PID | --slurm-job ID | --k8s-pod UID | "
                             "-- CMD ARGS...) [options]")
    tgt = r.add_mutually_exclusive_group()
    tgt.add_argument("--cgroup", metavar="PATH", help="cgroup2 group: absolute, or relative to the cgroup2 mount")
    tgt.add_argument("--pid", type=int, metavar="PID", help="a process and every descendant, also those forked later")
    tgt.add_argument("--slurm-job", metavar="ID", help="a SLURM job: its cgroup2 group, else its PIDs from scontrol")
    tgt.add_argument("--k8s-pod", metavar="UID", help="a Kubernetes pod on this node, by UID: its cgroup2 group "
                     "(every container of it), found under the kubelet's kubepods tree")
    r.add_argument("--job", metavar="NAME", help="job name in frames (default: from the target)")
    r.add_argument("--probes", metavar="SPEC",
                   help="'sched,perf' exactly these; '+pystacks,-sched' standard set plus/minus; 'all'")
    r.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds per tick (default 1.0)")
    r.add_argument("--rules", metavar="FILE|default", help="evaluate rules over the job's frames: `rule` events "
                   "with their evidence (docs/RULES.md)")
    r.add_argument("--trace-dir", metavar="DIR", default="jobprobe-traces",
                   help="where rules' deep-trace windows write their files (default ./jobprobe-traces)")
    r.add_argument("--trace-every", type=float, metavar="S", help="also a 25 s deep-trace window every S seconds")
    r.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    r.add_argument("--out", metavar="FILE", help="append msgpack frames to FILE")
    r.add_argument("--out-max-mb", type=float, metavar="MB", help="rotate FILE when it passes MB (FILE.1, FILE.2 …)")
    r.add_argument("--stdout", nargs="?", const="human", choices=["human", "json"],
                   help="a human line per tick (default when no --out), or 'json': one JSON frame per line")

    pr = sub.add_parser("probes", help="list every probe: default, fields and units, can it run here; with --job, "
                        "switch probes on or off for one attached job",
                        usage="jobprobe probes [--json] | jobprobe probes --job JOB +x,-y")
    pr.add_argument("--json", action="store_true", help="as JSON")
    pr.add_argument("--job", metavar="JOB", help="an attached job: toggle its probes at run time")
    pr.add_argument("toggle", nargs="?", metavar="+x,-y", help="with --job: probes to start (+) and stop (-)")
    pr.add_argument("--toggle", dest="toggle_opt", help=argparse.SUPPRESS)
    pr.add_argument("--socket", metavar="PATH", default=None, help="the agent's control socket")

    ag = sub.add_parser("agent", help="the node agent: attach/detach jobs at run time over its control socket")
    ag.add_argument("--config", metavar="FILE", default=None,
                    help="TOML settings (default /etc/jobprobe/agent.toml if it exists); flags win")
    ag.add_argument("--interval", type=float, metavar="S", help="seconds per tick (default 1.0)")
    ag.add_argument("--rules", metavar="FILE|default", help="rules evaluated over every job's frames (docs/RULES.md)")
    ag.add_argument("--trace-dir", metavar="DIR", help="deep-trace windows' files (default /var/lib/jobprobe/traces)")
    ag.add_argument("--trace-every", type=float, metavar="S", help="a 25 s deep-trace window every S s of each job")
    ag.add_argument("--probes", metavar="SPEC", help="default probes of attached jobs (as run's --probes)")
    ag.add_argument("--out", metavar="DIR", help="each job's frames to DIR/<job>.mpk")
    ag.add_argument("--out-max-mb", type=float, metavar="MB", help="rotate each job's file when it passes MB")
    ag.add_argument("--stdout", nargs="?", const="human", choices=["human", "json"], help="frames on stdout too")
    ag.add_argument("--socket", metavar="PATH", help="control socket (default /run/jobprobe/agent.sock)")
    ag.add_argument("--state", metavar="FILE", help="attached jobs, for a restart (default /run/jobprobe/jobs.json)")
    ag.add_argument("--attach-wait", type=float, metavar="S",
                    help="how long an attach waits for a job's processes to appear (default 30)")
    ag.add_argument("--queue", type=int, metavar="N", help="frames a sink may hold before dropping (default 1024)")
    ag.add_argument("--slurm", action="store_true", default=None,
                    help="a SLURM node: at start, attach the jobs running here (squeue) that no prolog attached")
    ag.add_argument("--slurm-node", metavar="NAME", help="this node's SLURM name (default: the short host name)")
    ag.add_argument("--k8s", metavar="URL", help="where this node's pod list comes from: the API server "
                    "(https://kubernetes.default.svc, with --k8s-node) or the node's kubelet (https://NODE:10250); "
                    "attach the pods annotated jobprobe.io/probe=true, detach them when they go")
    ag.add_argument("--k8s-node", metavar="NAME", help="this node's Kubernetes name (the downward API's "
                    "spec.nodeName): --k8s is the API server, asked for this node's pods (RBAC: list pods)")
    ag.add_argument("--k8s-every", type=float, metavar="S", help="seconds between looks at the pod list (default 5)")
    ag.add_argument("--k8s-token-file", metavar="FILE", help="bearer token for --k8s (a service account's)")
    ag.add_argument("--k8s-ca", metavar="FILE", help="CA of --k8s's certificate (default: the service account's "
                    "ca.crt in a pod, else the system's)")
    ag.add_argument("--k8s-insecure", action="store_true", default=None,
                    help="do not check --k8s's certificate; refused with --k8s-token-file (a token is never "
                    "sent to an unverified peer)")
    ag.add_argument("--send", metavar="nats://HOST:PORT", help="every job's frames to the controller's NATS "
                    "JetStream (comma-separate several servers)")
    ag.add_argument("--spool", metavar="DIR", help="frames waiting for the NATS server (default /var/lib/jobprobe/spool)")
    ag.add_argument("--spool-max-mb", type=float, metavar="MB", help="the spool's bound (default 256)")
    ag.add_argument("--nats-creds", metavar="FILE", help="this node's NATS credentials: a .creds (JWT + nkey), a .nk "
                    "seed, or a file holding user:password")
    ag.add_argument("--nats-ca", metavar="FILE", help="CA of the NATS servers' TLS certificates")
    ag.add_argument("--nats-insecure-plaintext", action="store_true", default=None,
                    help="allow a password or token file to go in clear to a NATS server that is not loopback "
                    "(refused otherwise: use an nkey from `jobprobe controller enroll`, or TLS)")
    ag.add_argument("--node", metavar="NAME", help="this node's name in frames (default: the short host name)")
    ag.add_argument("--prometheus", metavar="HOST:PORT", help="serve every job's metrics for Prometheus at "
                    "http://HOST:PORT/metrics (scrape with honor_labels: true)")

    co = sub.add_parser("controller", help="frames of every node from NATS JetStream into the store; `stats`: "
                        "freshness and delivery per node")
    co.add_argument("action", nargs="?", choices=["run", "stats", "enroll"], default="run",
                    help="run (default); stats; enroll NODE: write that node's NATS credentials (the path is the "
                         "last line printed) and let the running server know")
    co.add_argument("node", nargs="?", metavar="NODE", help="enroll: the node's name, as its agent's --node")
    co.add_argument("--nats", metavar="URL", help="the JetStream servers (default: start a nats-server here)")
    co.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:4222",
                    help="where the nats-server it starts listens (without --nats; default 127.0.0.1:4222)")
    co.add_argument("--data", metavar="DIR", default="/var/lib/jobprobe/controller",
                    help="its nats-server's data and the default store (default /var/lib/jobprobe/controller)")
    co.add_argument("--store", metavar="PATH", help="the store (default DATA/store.db)")
    co.add_argument("--retention-days", type=float, default=7.0, metavar="D", help="frames older go (default 7)")
    co.add_argument("--creds", metavar="FILE", help="the controller's NATS credentials (as the agent's --nats-creds; "
                    "without --nats: DATA/auth/controller.nk, made at the first start)")
    co.add_argument("--tls-cert", metavar="FILE", help="without --nats: the nats-server's TLS certificate (agents "
                    "then take --nats-ca)")
    co.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    co.add_argument("--insecure-plaintext", action="store_true", help="without --nats: listen on an address that "
                    "is not loopback without TLS (refused otherwise)")
    co.add_argument("--ca", metavar="FILE", help="CA of the NATS servers' TLS certificates")
    co.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="copies of the stream on a JetStream cluster (3 survives the loss of a server; default 1)")
    co.add_argument("--json", action="store_true", help="stats: as JSON")
    co.add_argument("--prices", metavar="FILE", help="a price file (jobprobe/cluster/cost.py): jobprobe_job_cost_total in "
                    "--metrics")
    co.add_argument("--tsdb", metavar="URL", help="also write every sample to VictoriaMetrics: "
                    "victoriametrics://HOST:8428 (a single node) or …://VMINSERT:8480/insert/0/prometheus")
    co.add_argument("--metrics", metavar="HOST:PORT", help="serve cluster-wide metrics for Prometheus (freshness "
                    "per node, nodes lost, frames stored and refused, stragglers named)")

    qu = sub.add_parser("query", help="read the controller's store: SQL, or one field of a job over time",
                        usage="jobprobe query --store PATH (--sql QUERY | --job ID --field PROBE.FIELD [--node N]) "
                              "[--format table|jsonl|csv]")
    qu.add_argument("--store", metavar="PATH", default="/var/lib/jobprobe/controller/store.db")
    qg = qu.add_mutually_exclusive_group(required=True)
    qg.add_argument("--sql", metavar="QUERY")
    qg.add_argument("--job", metavar="ID")
    qu.add_argument("--field", metavar="PROBE.FIELD")
    qu.add_argument("--node", metavar="N")
    qu.add_argument("--format", choices=["table", "jsonl", "csv"], default="table")
    qu.add_argument("--summary", action="store_true", help="with --job: the job's cost block (node-hours, GPU-hours, "
                    "energy, waste; money with --prices)")
    qu.add_argument("--prices", metavar="FILE", help="a price file (TOML; see jobprobe/cluster/cost.py)")

    at = sub.add_parser("attach", help="ask the agent to attach a job",
                        usage="jobprobe attach (--cgroup PATH | --pid PID | --slurm-job ID | --k8s-pod UID) "
                              "[--job NAME] [--probes SPEC]")
    atg = at.add_mutually_exclusive_group(required=True)
    atg.add_argument("--cgroup", metavar="PATH")
    atg.add_argument("--pid", type=int, metavar="PID")
    atg.add_argument("--slurm-job", metavar="ID")
    atg.add_argument("--k8s-pod", metavar="UID")
    at.add_argument("--job", metavar="NAME")
    at.add_argument("--probes", metavar="SPEC")
    at.add_argument("--wait", type=float, metavar="S", help="wait up to S s for the job's processes (SLURM, pods)")
    at.add_argument("--label", action="append", metavar="NAME=VALUE", default=[],
                    help="a name for the job carried in its frames' labels (user=…, partition=…); repeatable")
    at.add_argument("--from-start", action="store_true", default=None,
                    help="the job starts now: its first frame counts what it did before the attach")
    at.add_argument("--socket", metavar="PATH", default=None)
    dt = sub.add_parser("detach", help="ask the agent to detach a job (after a last frame)")
    dt.add_argument("job")
    dt.add_argument("--socket", metavar="PATH", default=None)
    dr = sub.add_parser("doctor", help="is this node ready? each check pass / warn / fail / absent, with its fix; "
                        "exit 0 (pass), 1 (warn), 3 (fail)")
    dr.add_argument("--json", action="store_true")
    dr.add_argument("--root", metavar="DIR", help="read DIR/sys, DIR/proc, DIR/lib/modules … instead of / (a fixture "
                    "tree, a chroot)")
    dr.add_argument("--controller", metavar="URL", help="also send the result to the controller through NATS "
                    "(`jobprobe controller stats` lists the nodes that are not ready)")
    dr.add_argument("--nats-creds", metavar="FILE", help="NATS credentials for --controller")
    dr.add_argument("--nats-ca", metavar="FILE", help="CA of the NATS servers' TLS certificates")
    dr.add_argument("--node", metavar="NAME", help="this node's name (default: the short host name)")
    tr = sub.add_parser("trace", help="open a deep-trace window for a job now: a Perfetto trace file of its Python "
                        "threads and what the kernel saw (docs/RULES.md)")
    tr.add_argument("--job", required=True)
    tr.add_argument("--duration", type=float, default=25.0, metavar="S", help="seconds (default 25)")
    tr.add_argument("--at", metavar="TIME", help="start then: UNIX seconds, +S (from now) or an ISO 8601 time "
                    "(default: now; with --nats, 3 s from now on every node)")
    tr.add_argument("--nats", metavar="URL", help="through the controller: a window on EVERY node of the job, with "
                    "one common start")
    tr.add_argument("--nats-creds", metavar="FILE", help="NATS credentials (.creds, .nk, or user:password): the "
                    "controller's key (DATA/auth/controller.nk), the one identity allowed to ask for traces")
    tr.add_argument("--nats-ca", metavar="FILE", help="CA of the NATS servers' TLS certificates")
    tr.add_argument("--socket", metavar="PATH", default=None)
    st = sub.add_parser("status", help="the agent's jobs, each probe's status per job, the agent's own cost")
    st.add_argument("--json", action="store_true")
    st.add_argument("--socket", metavar="PATH", default=None)

    b = sub.add_parser("bench", help="benchmarks: what the probes cost a job")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=Parser)
    ov = bsub.add_parser("overhead", help="paired runs of CMD without and with each config; slowdown with 95% interval",
                         usage="jobprobe bench overhead [--config C ...] [options] -- CMD ARGS...")
    ov.add_argument("--config", action="append", metavar="C",
                    help="'std' (standard set), 'std+pystacks', 'std-perf', or a --probes spec ('sched'); repeat")
    ov.add_argument("--interval", type=float, default=1.0, metavar="S")
    ov.add_argument("--max-runs", type=int, default=40, metavar="N", help="stop after N runs in all (default 40)")
    ov.add_argument("--max-minutes", type=float, default=30.0, metavar="M", help="stop after M minutes (default 30)")
    ov.add_argument("--min-pairs", type=int, default=3, metavar="N")
    ov.add_argument("--tolerance-pp", type=float, default=0.5, metavar="PP",
                    help="settled when the last three estimates agree within PP percentage points (default 0.5)")
    ov.add_argument("--precision-pp", type=float, metavar="PP",
                    help="also require the 95%% interval's half-width to be at most PP percentage points")
    ov.add_argument("--warmup", type=int, default=1, metavar="N", help="runs without jobprobe first, not counted")
    ov.add_argument("--seed", type=int)
    ov.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ov.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")

    pe = bsub.add_parser("peers", help="jobprobe's collector cost beside node_exporter's, same job and interval",
                         usage="jobprobe bench peers [--interval S] [--json FILE] -- CMD ARGS...")
    pe.add_argument("--interval", type=float, default=1.0, metavar="S")
    pe.add_argument("--json", metavar="FILE")

    ev = bsub.add_parser("events", help="ns an eBPF probe adds per kernel event, on vs off, with bcc's tool as peer")
    ev.add_argument("--probe", default="sched")
    ev.add_argument("--rounds", type=int, default=15)
    ev.add_argument("--n", type=int, default=100_000, help="workload size (round trips, calls)")
    ev.add_argument("--no-peer", action="store_true", help="skip the peer tool")
    ev.add_argument("--seed", type=int)
    ev.add_argument("--json", metavar="FILE")

    ba = bsub.add_parser("agent", help="the node agent with 1, 16, 64 jobs: ns per event, idle cost, attach "
                         "latency, leaks over attach/detach cycles")
    ba.add_argument("--jobs", default="1,16,64", help="numbers of attached jobs to measure (default 1,16,64)")
    ba.add_argument("--n", type=int, default=50_000, help="pingpong round trips per measurement")
    ba.add_argument("--idle-seconds", type=float, default=30.0)
    ba.add_argument("--cycles", type=int, default=1000)
    ba.add_argument("--probes", default="std", help="the agent's --probes (default: standard collection)")
    ba.add_argument("--no-peer", action="store_true", help="without bcc's runqlat beside it")
    ba.add_argument("--nats", action="store_true", help="the agent also sends its frames to a local nats-server and "
                    "controller (the NATS sink's cost included)")
    ba.add_argument("--json", metavar="FILE")

    bc = bsub.add_parser("controller", help="one controller against simulated nodes: keeps up at N nodes, its "
                         "ceiling in frames/s per core, a node's bytes on the wire")
    bc.add_argument("--nodes", type=int, default=2000)
    bc.add_argument("--seconds", type=float, default=30.0)
    bc.add_argument("--burst-frames", type=int, default=60_000)
    bc.add_argument("--json", metavar="FILE")

    acc = bsub.add_parser("accuracy", help="each figure summed over a job's frames beside the workload's own count "
                          "(dd's bytes, getrusage, its calls), N runs per case beside a neighbour load "
                          "(docs/ACCURACY.md); exit 1 if a row fails")
    acc.add_argument("--runs", type=int, default=20, metavar="N", help="runs per case (default 20)")
    acc.add_argument("--load", choices=["none", "cpu", "cpu+io", "net"], default="none",
                     help="neighbour load outside the job: stress-ng --cpu NCPU (cpu), plus --hdd 1 with O_DIRECT "
                     "(cpu+io), an iperf3 pair on loopback (net)")
    acc.add_argument("--interval", type=float, default=0.5, metavar="S")
    acc.add_argument("--only", action="append", metavar="CASES", help="only these cases, separated by commas "
                     "(dd-read-short, dd-read-long, dd-write-short, dd-write-long, cpu-burn, syscall-getppid, "
                     "fork-exit); repeat")
    acc.add_argument("--json", metavar="FILE")

    rd = sub.add_parser("read", help="decode a frame file (also one whose last frame was cut short)")
    rd.add_argument("file")
    rd.add_argument("--format", choices=["jsonl", "table", "summary"], default="jsonl",
                    help="jsonl: a frame per line; table: a row per sample; summary: per field n/mean/p50/max/sum")
    rp = sub.add_parser("report", help="one self-contained HTML page of a job: a verdict, per-node timelines, "
                        "stragglers and events", usage="jobprobe report (FILE… | --store PATH --job ID) -o OUT.html")
    rp.add_argument("files", nargs="*", metavar="FILE", help="frame files (the agents' --out, `run --out`)")
    rp.add_argument("--store", metavar="PATH", help="the controller's store (with --job)")
    rp.add_argument("--job", metavar="ID", help="the job, in the store")
    rp.add_argument("-o", "--out", metavar="HTML", default="report.html")
    rp.add_argument("--prices", metavar="FILE", help="a price file (jobprobe/cluster/cost.py): the job's cost at the top")
    return p


# ---- probes ------------------------------------------------------------------------------------------------
def cmd_probes(args, host: Host) -> int:
    from jobprobe.node.registry import all_probes
    reg = all_probes()
    rows = []
    for name, cls in reg.items():
        why = cls(host).check(host)
        rows.append({"name": name, "default": cls.default, "runs_here": why is None, "why_not": why,
                     "summary": cls.summary,
                     "fields": {k: {"type": f.type, "unit": f.unit, "kind": f.kind, "meaning": f.meaning}
                                for k, f in cls.fields.items()}})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        state = "runs here" if row["runs_here"] else f"cannot run here: {row['why_not']}"
        print(f"{row['name']:<10} {'default on ' if row['default'] else 'default off'}  {state}")
        print(f"           {row['summary']}")
        for k, f in row["fields"].items():
            print(f"             {k:<24} {f['type']:<9} {f['unit']:<8} {f['kind']:<9} {f['meaning']}")
    return 0


# ---- read --------------------------------------------------------------------------------------------------
def _table(frames: list[dict]) -> str:
    cols: dict[str, None] = {}
    rows = []
    for f in frames:
        if f["kind"] != "sample":
            continue
        row = {"seq": str(f["seq"]), "time": time.strftime("%H:%M:%S", time.localtime(f["t"])),
               "dt": f"{f['dt']:.3f}"}
        for probe, fields in f.get("probes", {}).items():
            for k, v in fields.items():
                if isinstance(v, (int, float, str)) or v is None:
                    row[f"{probe}.{k}"] = "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        cols.update(dict.fromkeys(row))
        rows.append(row)
    names = list(cols)
    width = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in names} if rows else {}
    lines = ["  ".join(c.rjust(width[c]) for c in names)]
    lines += ["  ".join(r.get(c, "").rjust(width[c]) for c in names) for r in rows]
    return "\n".join(lines)


def _summary(frames: list[dict]) -> str:
    """Per numeric field over the sample frames: n, mean, median, max, sum. The first and last samples cover
    partial intervals (start-up, the job's end), so rates are better judged from the median."""
    series: dict[str, list[float]] = {}
    for f in frames:
        if f["kind"] == "sample":
            for probe, fields in f.get("probes", {}).items():
                for k, v in fields.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        series.setdefault(f"{probe}.{k}", []).append(v)
    lines = [f"{'field':<34} {'n':>5} {'mean':>14} {'p50':>14} {'max':>14} {'sum':>16}"]
    for k, xs in series.items():
        ys = sorted(xs)
        lines.append(f"{k:<34} {len(xs):>5} {sum(xs) / len(xs):>14.6g} {ys[len(ys) // 2]:>14.6g} {ys[-1]:>14.6g} "
                     f"{sum(xs):>16.6g}")
    return "\n".join(lines)


def cmd_read(args) -> int:
    try:
        fp = open(args.file, "rb")
    except OSError as err:
        raise BadInput(f"cannot open {args.file}: {err.strerror}") from err
    reader = StreamReader(fp)
    frames: list[dict] = []
    err: MalformedFrame | None = None
    with fp:
        try:
            for frame in reader:
                if args.format == "jsonl":
                    print(json.dumps(frame, separators=(",", ":"), default=str))
                else:
                    frames.append(frame)
        except MalformedFrame as e:
            err = e
    if args.format == "table":
        print(_table(frames))
    elif args.format == "summary":
        print(_summary(frames))
    sys.stdout.flush()
    if reader.truncated:
        off, left = reader.truncated
        print(f"jobprobe: warning: {args.file}: last frame cut short at byte {off} ({left} bytes dropped); "
              f"{reader.count} frames read", file=sys.stderr)
    if err is not None:
        raise BadInput(f"{args.file}: {err}; {reader.count} frames read before it")
    return 0


# ---- run ---------------------------------------------------------------------------------------------------
def make_target(args, command: list[str]):
    from jobprobe.node.target import CgroupTarget, CommandTarget, PidTreeTarget, k8s_pod_target, slurm_target
    given = [x for x in (args.cgroup, args.pid, args.slurm_job, args.k8s_pod) if x is not None]
    if command and given:
        raise BadInput("give either a target option (--cgroup/--pid/--slurm-job/--k8s-pod) or -- CMD, not both")
    if command:
        return CommandTarget(command, job=args.job)
    if args.cgroup is not None:
        return CgroupTarget(args.cgroup, job=args.job)
    if args.pid is not None:
        return PidTreeTarget([args.pid], job=args.job)
    if args.slurm_job is not None:
        return slurm_target(args.slurm_job, job=args.job)
    if args.k8s_pod is not None:
        return k8s_pod_target(args.k8s_pod, job=args.job)
    raise BadInput("no target: give --cgroup PATH, --pid PID, --slurm-job ID, --k8s-pod UID or -- CMD ARGS...")


def cmd_run(args, command: list[str], host: Host) -> int:
    """The agent with one job, in the foreground: the same job table, tick and sinks as `jobprobe agent`."""
    from jobprobe.exporters.file import FileExporter
    from jobprobe.exporters.queued import QueuedSink
    from jobprobe.exporters.stdout import StdoutExporter
    from jobprobe.node.agent import Agent, Config
    from jobprobe.node.registry import all_probes, parse_probes
    from jobprobe.node.target import CommandTarget

    if args.interval <= 0:
        raise BadInput(f"--interval must be positive, got {args.interval}")
    reg = all_probes()
    names = parse_probes(args.probes, reg)
    if not host.is_root:
        need = [n for n in names if reg[n].needs_root]
        if need:
            raise BadInput(f"not root: probes {', '.join(need)} need root (BPF, perf_event on cgroups); "
                           f"run as root or choose --probes {','.join(n for n in names if n not in need) or 'self'}")
    target = make_target(args, command)
    sinks: list = []
    agent = None
    try:
        if args.out:
            try:
                sinks.append(QueuedSink(FileExporter(args.out, args.out_max_mb), "file"))
            except OSError as err:
                raise BadInput(f"cannot write {args.out}: {err.strerror}") from err
        if args.stdout or not args.out:
            sinks.append(QueuedSink(StdoutExporter(args.stdout or "human"), "stdout"))
        agent = Agent(Config(interval=args.interval, rules=args.rules, trace_dir=args.trace_dir,
                             trace_every=args.trace_every), host)

        def on_signal(signum, _frame):
            agent.stop_event.set()
            child = getattr(target, "proc_handle", None)
            if child is not None and child.poll() is None:
                child.send_signal(signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        agent.attach_target(target, names, sinks=sinks)
        child = None
        if isinstance(target, CommandTarget):
            child = target.launch()
            # Wake the loop as soon as CMD exits, so its last partial interval is sampled at once.
            threading.Thread(target=lambda: (child.wait(), agent.stop_event.set()), daemon=True).start()
        agent.run(until=lambda: not agent.jobs, duration=args.duration)
        ended = [r for r in agent.recent if r["job"] == target.job]
        if ended and not isinstance(target, CommandTarget):
            # the job ended on its own (not a signal, not --duration, not CMD's exit): say so once
            logging.getLogger("jobprobe").warning("job ended: %s", ended[-1]["why"])
        agent.close()
        if child is not None:
            child.wait()
            return child.returncode if child.returncode >= 0 else 128 - child.returncode
        return 0
    finally:
        if agent is not None:
            agent.close()
        else:
            for sink in sinks:
                sink.close()
        target.close()


# ---- the agent and its clients ------------------------------------------------------------------------------
def socket_path(args) -> str:
    from jobprobe.node.agent import Config
    return args.socket or os.environ.get("JOBPROBE_SOCKET") or Config.socket


def cmd_agent(args, host: Host) -> int:
    from jobprobe.node.agent import DEFAULT_CONFIG, Agent, Config
    from jobprobe.node.control import ControlServer
    if not host.is_root:
        raise BadInput("not root: the agent loads eBPF programs and serves a root-only socket; run it as root")
    cfg = Config.load(args.config or DEFAULT_CONFIG,
                      {"interval": args.interval, "probes": args.probes, "out": args.out,
                       "out_max_mb": args.out_max_mb, "stdout": args.stdout, "socket": args.socket,
                       "state": args.state, "attach_wait": args.attach_wait, "queue": args.queue,
                       "slurm": args.slurm, "slurm_node": args.slurm_node, "k8s": args.k8s,
                       "k8s_every": args.k8s_every, "k8s_token_file": args.k8s_token_file, "k8s_ca": args.k8s_ca,
                       "k8s_insecure": args.k8s_insecure, "k8s_node": args.k8s_node, "nats": args.send, "spool": args.spool,
                       "spool_max_mb": args.spool_max_mb, "nats_creds": args.nats_creds, "nats_ca": args.nats_ca,
                       "nats_insecure_plaintext": args.nats_insecure_plaintext,
                       "node": args.node, "prometheus": args.prometheus, "rules": args.rules,
                       "trace_dir": args.trace_dir, "trace_every": args.trace_every})
    from jobprobe.node.registry import all_probes, parse_probes
    parse_probes(cfg.probes, all_probes())       # an unknown probe in the config: said now, exit 2
    if cfg.k8s:     # a token for an unverified peer, or an unreadable CA: said now, exit 2
        from jobprobe.node.k8s import pods_path, tls_context
        tls_context(cfg.k8s, cfg.k8s_ca, cfg.k8s_insecure, cfg.k8s_token_file)
        pods_path(cfg.k8s_node)
    try:
        agent = Agent(cfg, host)
    except (ValueError, OSError) as err:  # a credentials file unreadable or malformed, a spool or port not usable
        raise BadInput(f"agent: {err}") from None
    server = ControlServer(agent, cfg.socket)
    agent.ready.clear()           # requests wait until the programs are loaded and the jobs restored
    server.start()

    def on_signal(signum, _frame):
        agent.stop_event.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    watcher = None
    try:
        for name, state in agent.preload().items():   # the node's programs: loaded once, before any job
            logging.getLogger("jobprobe").info("%s: %s", name, state)
        agent.persist = True
        for r in agent.restore():
            logging.getLogger("jobprobe").warning("restart: %s %s", r.get("job"), r.get("state"))
        if cfg.slurm:
            for r in agent.adopt_slurm():
                logging.getLogger("jobprobe").warning("SLURM job running here: %s %s", r.get("job"), r.get("state"))
        agent.ready.set()
        logging.getLogger("jobprobe").warning("agent ready on %s (run %s)", cfg.socket, agent.run_id)
        if cfg.k8s:
            from jobprobe.node.k8s import PodWatcher
            watcher = PodWatcher(agent, cfg.k8s, every=cfg.k8s_every, token_file=cfg.k8s_token_file,
                                 ca_file=cfg.k8s_ca, insecure=cfg.k8s_insecure, node=cfg.k8s_node)
            watcher.start()
        agent.run()
    finally:
        if watcher is not None:
            watcher.stop()
        server.close()
        agent.close()
    return 0


def cmd_controller(args) -> int:
    import asyncio
    from jobprobe.cluster.controller import Controller, LocalNats, stats
    from jobprobe.cluster.store import Store
    path = args.store or os.path.join(args.data, "store.db")
    if args.action == "enroll":
        return controller_enroll(args)
    if args.node:
        raise BadInput(f"controller {args.action}: takes no node name (did you mean `controller enroll NODE`?)")
    if args.action == "stats":
        try:
            st = stats(Store(path, readonly=True))
        except FileNotFoundError as err:
            raise BadInput(str(err)) from None
        if args.json:
            print(json.dumps(st, indent=1))
            return 0
        print(f"{'node':<20} {'frames':>8} {'dup':>5} {'rej':>5} {'newest age s':>13} {'delay p50/p99 s':>16} "
              f"{'longest gap s':>14} {'dropped':>8} {'missing':>8}")
        for node, n in sorted(st["nodes"].items()):
            d = n.get("arrival_delay_s") or {}
            print(f"{node:<20} {n.get('frames', 0):>8} {n.get('duplicates', 0):>5} {n.get('rejected', 0):>5} "
                  f"{n.get('newest_sample_age_s')!s:>13} {str(d.get('median')) + '/' + str(d.get('p99')):>16} "
                  f"{n.get('longest_gap_s')!s:>14} {n.get('dropped_at_source', 0):>8} {n.get('missing_frames', 0):>8}")
        for node, n in sorted(st["nodes"].items()):
            doc = n.get("doctor")
            if doc and doc["worst"] != "pass":
                print(f"{node}: doctor {doc['worst']}" + (f" ({', '.join(doc['not_pass'])})" if doc["not_pass"]
                                                          else "") + (" — NOT READY" if doc["worst"] == "fail" else ""))
        return 0
    if args.prices:
        from jobprobe.cluster.cost import load as load_prices
        load_prices(args.prices)         # a bad price file: one line, before anything starts
    local = None
    url = args.nats
    creds = args.creds
    if url is None:
        local = LocalNats(args.data, args.listen, args.tls_cert, args.tls_key, args.insecure_plaintext)
        local.wait()
        url, creds = local.url, creds or local.creds
    elif args.tls_cert or args.insecure_plaintext:
        raise BadInput("--tls-cert and --insecure-plaintext are for the nats-server the controller starts (no --nats)")
    store = Store(path)
    ctl = Controller(store, url, retention_s=args.retention_days * 86400, creds=creds, ca=args.ca,
                     replicas=args.replicas, tsdb=args.tsdb, prices=args.prices)
    server = None
    if args.metrics:
        from jobprobe.cluster.controller import serve_metrics
        try:
            server = serve_metrics(ctl, args.metrics)
        except (ValueError, OSError) as err:
            raise BadInput(f"--metrics {args.metrics}: {err}") from None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, ctl.stop_event.set)
        await ctl.run()
    try:
        asyncio.run(main())
    finally:
        if server is not None:
            server.shutdown()
        store.close()
        if local is not None:
            local.stop()
    return 0


def controller_enroll(args) -> int:
    """A node's credentials: a new nkey (replacing any it had), its public half in the server's authorization, the
    running server told (SIGHUP). The seed's path is the last line: copy the file to the node (0600) and give it
    to `jobprobe agent --nats-creds`."""
    from jobprobe.cluster.controller import write_auth
    from jobprobe.transport.natsauth import Auth, reload_server
    if not args.node:
        raise BadInput("controller enroll: give the node's name (its agent's --node)")
    auth = Auth(args.data)
    auth.controller_seed()
    path = auth.enroll(args.node)
    write_auth(args.data)
    pid = reload_server(args.data)
    print(f"enrolled {args.node}: " + (f"the running nats-server (pid {pid}) reloaded its users" if pid else
                                       "no nats-server runs for this data directory; the next start admits it"))
    print(path)
    return 0


def cmd_report(args) -> int:
    import importlib.util
    from jobprobe.cluster import report
    if importlib.util.find_spec("matplotlib") is None:
        raise BadInput("report: needs matplotlib (pip install 'jobprobe[report]')")
    if bool(args.files) == bool(args.store):
        raise BadInput("report: give frame files, or --store PATH --job ID")
    if args.store:
        if not args.job:
            raise BadInput("report: --store needs --job ID")
        if not os.path.exists(args.store):
            raise BadInput(f"report: no store at {args.store}")
        job = report.from_store(args.store, args.job)
    else:
        for f in args.files:
            if not os.path.isfile(f):
                raise BadInput(f"report: no frame file {f}")
        job = report.from_files(args.files)
    cost = None
    if args.prices:
        from jobprobe.cluster import cost as _cost
        prices = _cost.load(args.prices)
        cost = _cost.summary(_store_of(args.store, args.files), job.name, prices)
    size = report.write(job, args.out, cost)
    print(f"{args.out}: {job.name}, {len(job.nodes)} node(s), {size / 1024:.0f} KiB")
    return 0


def _store_of(path: str | None, files: list[str]):
    """The controller's store, or an in-memory one made of frame files."""
    from jobprobe.cluster.store import Store
    if path:
        return Store(path, readonly=True)
    st = Store(":memory:")
    for f in files:
        with open(f, "rb") as fp:
            st.add(list(StreamReader(fp)))
    return st


def cmd_query(args) -> int:
    import csv
    import sqlite3
    from jobprobe.cluster.store import Store
    try:
        store = Store(args.store, readonly=True)
    except FileNotFoundError as err:
        raise BadInput(str(err)) from None
    if args.summary or args.prices:
        from jobprobe.cluster import cost
        if not args.job:
            raise BadInput("--summary needs --job ID")
        s = cost.summary(store, args.job, cost.load(args.prices) if args.prices else None)
        print(json.dumps(s, indent=1) if args.format == "jsonl" else cost.text(s))
        return 0
    try:
        if args.sql:
            cols, rows = store.sql(args.sql)
        else:
            if not args.field:
                raise BadInput("--job needs --field PROBE.FIELD (e.g. cgroup.cpu_user_ns)")
            cols, rows = store.field(args.job, args.field, args.node)
    except (sqlite3.Error, ValueError) as err:
        raise BadInput(f"query: {err}") from None
    if args.format == "jsonl":
        for r in rows:
            print(json.dumps(dict(zip(cols, r))))
    elif args.format == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    else:
        widths = [max([len(c)] + [len(str(r[i])) for r in rows]) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    return 0


def client_call(args, req: dict) -> dict:
    from jobprobe.node.control import call
    reply = call(socket_path(args), req)
    if not reply.get("ok"):
        raise BadInput(reply.get("error") or "the agent refused")
    return reply


def cmd_attach(args) -> int:
    req = {"cmd": "attach", "cgroup": args.cgroup, "pid": args.pid, "slurm_job": args.slurm_job,
           "k8s_pod": args.k8s_pod, "job": args.job, "probes": args.probes, "wait": args.wait,
           "from_start": args.from_start}
    if args.label:
        bad = [x for x in args.label if "=" not in x or not x.split("=", 1)[0]]
        if bad:
            raise BadInput(f"--label {bad[0]!r}: give NAME=VALUE")
        req["labels"] = dict(x.split("=", 1) for x in args.label)
    r = client_call(args, {k: v for k, v in req.items() if v is not None})
    extra = f": {r['why']}" if r.get("why") else (f" ({r['note']})" if r.get("note") else "")
    if r["state"] == "pending":
        extra = f" (waiting up to {r['waiting_s']:g} s for its processes: {r['why']})"
    print(f"{r['job']}: {r['state']}{extra}")
    return 0


def cmd_doctor(args) -> int:
    import dataclasses
    from jobprobe.node import doctor
    host = Host()
    if args.root:
        if not os.path.isdir(args.root):
            raise BadInput(f"--root {args.root}: not a directory")
        host = dataclasses.replace(host, sys=os.path.join(args.root, "sys"), proc=os.path.join(args.root, "proc"))
    if args.node:
        host = dataclasses.replace(host, node=args.node)
    checks = doctor.run(doctor.Ctx(host, root=args.root or "", nvml=doctor.open_nvml()))
    print(json.dumps({"node": host.node, **doctor.as_dict(checks)}, indent=1) if args.json else doctor.text(checks))
    if args.controller:
        send_doctor(args, host.node, doctor.as_dict(checks))
    return doctor.exit_code(checks)


def send_doctor(args, node: str, result: dict) -> None:
    """The result as an `event` frame (job `node`, event `doctor`) into the frames' stream, as an agent sends."""
    from jobprobe.core.wire import frames_subject, inbox_prefix, msg_id
    from jobprobe.transport.credentials import NatsError
    from jobprobe.transport.natswire import Wire
    from jobprobe.core.frame import FrameBuilder, encode
    fr = FrameBuilder(node, "node", f"doctor-{int(time.time() * 1000)}").event(time.time(), "doctor", **result)
    try:
        wire = Wire(args.controller, args.nats_creds, args.nats_ca, name="jobprobe-doctor", inbox=inbox_prefix(node))
    except (OSError, ValueError) as err:
        raise BadInput(f"doctor: --nats-creds: {err}") from None
    try:
        wire.connect()
        wire.publish([(frames_subject(node), msg_id(fr), encode(fr))], timeout=10)
    except (OSError, NatsError) as err:
        raise BadInput(f"doctor: the result could not be sent to {args.controller}: {err}") from err
    finally:
        wire.close()


def parse_at(text: str | None, now: float) -> float | None:
    """--at: UNIX seconds, +S from now, or an ISO 8601 time (UTC unless it says its zone)."""
    if text is None:
        return None
    try:
        return now + float(text[1:]) if text.startswith("+") else float(text)
    except ValueError:
        pass
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"--at {text!r}: give UNIX seconds, +S, or an ISO 8601 time") from None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def cmd_trace(args) -> int:
    at = parse_at(args.at, time.time())
    if args.nats:
        return cluster_trace(args, at)
    r = client_call(args, {"cmd": "trace", "job": args.job, "duration": args.duration, "at": at})
    if not r.get("ok", True) or r.get("state") == "refused":
        raise BadInput(f"trace {args.job}: refused: {r.get('why')}")
    if r["state"] == "scheduled":
        print(f"{r['job']}: a {r['duration_s']:g} s window opens in {r['in_s']:.1f} s (at {r['at']:.3f})")
    else:
        print(f"{r['job']}: tracing for {r['duration_s']:g} s → {r['path']}")
    return 0


def cluster_trace(args, at: float | None) -> int:
    """Ask the controller for a window on every node of the job; print each node's answer."""
    from jobprobe.core.wire import CLUSTER_TRACE
    from jobprobe.transport.credentials import NatsError
    from jobprobe.transport.natswire import Wire
    try:
        wire = Wire(args.nats, args.nats_creds, args.nats_ca, name="jobprobe-trace")
    except (OSError, ValueError) as err:
        raise BadInput(f"trace: --nats-creds: {err}") from None
    try:
        wire.connect()
        data = wire.request(CLUSTER_TRACE, json.dumps({"job": args.job, "duration": args.duration,
                                                       "at": at}).encode(), timeout=15)
    except (OSError, NatsError) as err:
        raise BadInput(f"trace {args.job}: the controller did not answer through {args.nats}: {err}") from err
    finally:
        wire.close()
    r = json.loads(data)
    if "nodes" not in r:
        raise BadInput(f"trace {args.job}: {r.get('error')}")
    print(f"{args.job}: a {r['duration_s']:g} s window on {len(r['nodes'])} node(s) at {r['at']:.3f}")
    for node, a in r["nodes"].items():
        print(f"  {node}: {a.get('state') or 'refused'}" + (f" ({a.get('why') or a.get('error')})"
                                                           if a.get("why") or a.get("error") else ""))
    if not r["ok"]:
        raise BadInput(f"trace {args.job}: no node opened a window")
    return 0


def cmd_detach(args) -> int:
    r = client_call(args, {"cmd": "detach", "job": args.job})
    print(f"{r['job']}: {r['state']}")
    return 0


def cmd_status(args) -> int:
    r = client_call(args, {"cmd": "status"})
    if args.json:
        print(json.dumps(r, indent=1, default=str))
        return 0
    a = r["agent"]
    print(f"node {r['node']}  run {r['run']}  interval {r['interval']:g} s  agent pid {a['pid']}  "
          f"{a['cpu_cores']:.4f} cores  {a['rss_bytes'] / 2**20:.1f} MiB")
    for j in r["jobs"]:
        print(f"  {j['job']}  slot {j['slot']}  frames {j['frames']}  {j['target']}")
        for name, state in j["probes"].items():
            print(f"      {name:<10} {state}")
    for p in r["pending"]:
        print(f"  {p['job']}  pending ({p['waiting_s']:g} s left): {p['why']}")
    if not r["jobs"] and not r["pending"]:
        print("  no jobs attached")
    return 0


def cmd_bench(args, command: list[str], host: Host) -> int:
    from jobprobe.bench.overhead import OverheadBench, write_outputs
    if not host.is_root:
        raise BadInput("not root: the benchmarks create cgroups and run jobprobe's probes")
    if args.bench == "events":
        from pathlib import Path
        from jobprobe.bench import events
        res = events.bench_events(args.probe, args.rounds, args.n, not args.no_peer, args.seed, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(events.markdown(res))
        return 0
    if args.bench == "agent":
        from pathlib import Path
        from jobprobe.bench import agent as agent_bench
        try:
            counts = tuple(int(x) for x in args.jobs.split(","))
        except ValueError:
            raise BadInput(f"--jobs: numbers separated by commas, got {args.jobs!r}") from None
        if not counts or min(counts) < 1 or max(counts) > 64:
            raise BadInput("--jobs: each between 1 and 64 (the node's job slots)")
        res = agent_bench.bench_agent(counts, args.n, args.idle_seconds, args.cycles, args.probes, not args.no_peer,
                                      progress=sys.stderr, nats=args.nats)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(agent_bench.markdown(res))
        return 0
    if args.bench == "controller":
        from pathlib import Path
        from jobprobe.bench import controller as ctl_bench
        res = ctl_bench.bench_controller(args.nodes, args.seconds, args.burst_frames, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(ctl_bench.markdown(res))
        return 0
    if args.bench == "accuracy":
        from pathlib import Path
        from jobprobe.bench import accuracy
        res = accuracy.bench_accuracy(args.runs, args.load, args.interval, args.only, progress=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(accuracy.markdown(res))
        return 0 if res["pass"] else 1
    if not command:
        raise BadInput(f"nothing to run: jobprobe bench {args.bench} [options] -- CMD ARGS...")
    if args.bench == "peers":
        from pathlib import Path
        from jobprobe.bench import peers
        res = peers.run_peers(command, args.interval)      # its own mkdtemp scratch directory
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        print(peers.markdown(res))
        return 0
    for c in args.config or []:
        _check_config(c)
    bench = OverheadBench(command, args.config or ["std"], interval=args.interval, max_runs=args.max_runs,
                          max_minutes=args.max_minutes, min_pairs=args.min_pairs, tol=args.tolerance_pp / 100,
                          warmup=args.warmup, seed=args.seed,
                          precision=args.precision_pp / 100 if args.precision_pp else None)
    print(write_outputs(bench.run(), args.json, args.markdown))
    return 0


def _check_config(config: str) -> None:
    import tempfile
    from pathlib import Path
    from jobprobe.bench.overhead import config_options, config_probes
    from jobprobe.node.registry import all_probes, parse_probes
    with tempfile.TemporaryDirectory() as d:
        base, _ = config_options(config, Path(d))       # raises BadInput naming an unknown @option
    parse_probes(config_probes(base), all_probes())   # raises BadInput naming an unknown probe


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    logging.basicConfig(format="jobprobe: %(message)s", level=logging.WARNING, stream=sys.stderr)
    host = Host()
    if argv[:1] == ["probes"] and "--job" in argv:   # a toggle such as "-sched" is a value, not an option
        argv = [f"--toggle={a}" if a[:1] in "+-" and a[1:2].isalpha() else a for a in argv]
    try:
        args = build_parser().parse_args(argv)
        if command and args.cmd not in ("run", "bench"):
            raise BadInput("-- CMD is only for 'jobprobe run' and 'jobprobe bench'")
        if args.cmd == "probes":
            args.toggle = args.toggle or args.toggle_opt
            if args.job or args.toggle:
                if not (args.job and args.toggle):
                    raise BadInput("give both: jobprobe probes --job JOB +x,-y")
                r = client_call(args, {"cmd": "probes", "job": args.job, "toggle": args.toggle})
                print("\n".join(f"{r['job']}: {n} {st}" for n, st in r["probes"].items()))
                return 0
            return cmd_probes(args, host)
        if args.cmd == "agent":
            return cmd_agent(args, host)
        if args.cmd == "attach":
            return cmd_attach(args)
        if args.cmd == "detach":
            return cmd_detach(args)
        if args.cmd == "status":
            return cmd_status(args)
        if args.cmd == "controller":
            return cmd_controller(args)
        if args.cmd == "query":
            return cmd_query(args)
        if args.cmd == "read":
            return cmd_read(args)
        if args.cmd == "report":
            return cmd_report(args)
        if args.cmd == "trace":
            return cmd_trace(args)
        if args.cmd == "doctor":
            return cmd_doctor(args)
        if args.cmd == "bench":
            return cmd_bench(args, command, host)
        return cmd_run(args, command, host)
    except BadInput as err:   # 2; 127/126 for a -- CMD that is not there / cannot be executed (shell convention)
        print(f"jobprobe: error: {err}", file=sys.stderr)
        return err.exit_code
    except JobprobeError as err:
        print(f"jobprobe: error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
