# SPDX-License-Identifier: Apache-2.0
"""The command line's grammar: build_parser() declares every subcommand, its options and, with
set_defaults(func=...), the function that carries it out; and the two rewrites of argv that argparse cannot
express (split_command, toggles_as_options)."""
from __future__ import annotations

import argparse

from jobprobe import __version__
from jobprobe.cli import bench, cluster, frames, node
from jobprobe.core.errors import BadInput


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, not usage + error
        raise BadInput(message)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but `controller tls|enroll` takes its names after its options too (`controller tls
        --data D HOST…`): argparse stops filling a positional at the first option and would call the rest
        unrecognized."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra and getattr(ns, "cmd", None) == "controller" and getattr(ns, "action", None) in ("tls", "enroll") \
                and not any(x.startswith("-") for x in extra):
            ns.node += extra
        elif extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


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
    r.set_defaults(func=node.cmd_run)

    pr = sub.add_parser("probes", help="list every probe: default, fields and units, can it run here; with --job, "
                        "switch probes on or off for one attached job",
                        usage="jobprobe probes [--json] | jobprobe probes --job JOB +x,-y")
    pr.add_argument("--json", action="store_true", help="as JSON")
    pr.add_argument("--job", metavar="JOB", help="an attached job: toggle its probes at run time")
    pr.add_argument("toggle", nargs="?", metavar="+x,-y", help="with --job: probes to start (+) and stop (-)")
    pr.add_argument("--toggle", dest="toggle_opt", help=argparse.SUPPRESS)
    pr.add_argument("--socket", metavar="PATH", default=None, help="the agent's control socket")
    pr.set_defaults(func=node.cmd_probes)

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
    ag.add_argument("--k8s-labels", metavar="KEY,…", help="pod labels copied into each pod's job labels (frames, "
                    "and /metrics where the config's prometheus_labels names them; app.kubernetes.io/name becomes "
                    "app_kubernetes_io_name)")
    ag.add_argument("--k8s-every", type=float, metavar="S", help="seconds between looks at the pod list (default 5)")
    ag.add_argument("--k8s-token-file", metavar="FILE", help="bearer token for --k8s (a service account's)")
    ag.add_argument("--k8s-ca", metavar="FILE", help="CA of --k8s's certificate (default: the service account's "
                    "ca.crt in a pod, else the system's)")
    ag.add_argument("--k8s-insecure", action="store_true", default=None,
                    help="do not check --k8s's certificate; refused with --k8s-token-file (a token is never "
                    "sent to an unverified peer)")
    ag.add_argument("--send", metavar="nats://HOST:PORT", help="every job's frames to the controller's NATS "
                    "JetStream (comma-separate several servers)")
    ag.add_argument("--spool", metavar="DIR",
                    help="frames waiting for the NATS server (default /var/lib/jobprobe/spool)")
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
    ag.set_defaults(func=node.cmd_agent)

    co = sub.add_parser("controller", help="frames of every node from NATS JetStream into the store; `stats`: "
                        "freshness and delivery per node")
    co.add_argument("action", nargs="?", choices=["run", "stats", "enroll", "tls", "mappings"], default="run",
                    help="run (default); stats; enroll NODE: write that node's NATS credentials (the path is the "
                         "last line printed) and let the running server know; tls HOST…: a CA and the server's "
                         "certificate for the names agents dial, under DATA/tls (docs/SECURITY.md); mappings: the "
                         "subject mapping a NATS server's config needs for --partition I/N")
    co.add_argument("node", nargs="*", metavar="NAME", help="enroll: the node's name, as its agent's --node; tls: "
                    "the controller's names and addresses")
    co.add_argument("--nats", metavar="URL", help="the JetStream servers (default: start a nats-server here)")
    co.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:4222",
                    help="where the nats-server it starts listens (without --nats; default 127.0.0.1:4222)")
    co.add_argument("--data", metavar="DIR", default="/var/lib/jobprobe/controller",
                    help="its nats-server's data and the default store (default /var/lib/jobprobe/controller)")
    co.add_argument("--store", metavar="PATH", help="the store (default DATA/store.db)")
    co.add_argument("--retention-days", type=float, default=7.0, metavar="D", help="frames older go (default 7)")
    co.add_argument("--suspect-jobs", type=int, default=3, metavar="K", help="a node named the straggler of K "
                    "distinct jobs within --suspect-window gets a node_suspect event (default 3; 0: never)")
    co.add_argument("--suspect-window", default="7d", metavar="LEN", help="how far back a node's stragglers count "
                    "(90s, 30m, 12h, 1d, 2w; default 7d)")
    co.add_argument("--stream-hours", type=float, default=168.0, metavar="H", help="how long the stream keeps "
                    "frames no controller took (its max_age; default 168: a week)")
    co.add_argument("--raw-minutes", type=float, default=10.0, metavar="M", help="samples kept whole as JSON this "
                    "long, then compacted into column blocks and 10 s / 1 min rollups (default 10)")
    co.add_argument("--creds", metavar="FILE", help="the controller's NATS credentials (as the agent's --nats-creds; "
                    "without --nats: DATA/auth/controller.nk, made at the first start)")
    co.add_argument("--tls-cert", metavar="FILE", help="without --nats: the nats-server's TLS certificate (agents "
                    "then take --nats-ca)")
    co.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    co.add_argument("--insecure-plaintext", action="store_true", help="without --nats: listen on an address that "
                    "is not loopback without TLS (refused otherwise)")
    co.add_argument("--ca", metavar="FILE", help="CA of the NATS servers' TLS certificates")
    co.add_argument("--partition", type=_partition, default=(0, 1), metavar="I/N",
                    help="take partition I of N: the frames of the jobs the server maps there (docs/DEPLOY.md); "
                         "two controllers of one partition: one active, one standing by (default 0/1)")
    co.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="copies of the stream on a JetStream cluster (3 survives the loss of a server; default 1)")
    co.add_argument("--json", action="store_true", help="stats: as JSON")
    co.add_argument("--prices", metavar="FILE", help="a price file (jobprobe/cluster/cost.py): "
                    "jobprobe_job_cost_total in "
                    "--metrics")
    co.add_argument("--tsdb", metavar="URL", help="also write every sample to VictoriaMetrics: "
                    "victoriametrics://HOST:8428 (a single node) or …://VMINSERT:8480/insert/0/prometheus")
    co.add_argument("--quota", metavar="NAME=VALUE", action="append", help="a per-node quota (docs/SECURITY.md): "
                    "frames_per_s (default 1000), bytes_per_s (4194304), live_jobs (512), max_frame (1048576); "
                    "again for another")
    co.add_argument("--metrics", metavar="HOST:PORT", help="serve cluster-wide metrics for Prometheus (freshness "
                    "per node, nodes lost, frames stored and refused, stragglers named)")
    co.set_defaults(func=cluster.cmd_controller)

    qu = sub.add_parser("query", help="read the controller's store: SQL, or one field of a job over time",
                        usage="jobprobe query --store PATH (--sql QUERY | --job ID --field PROBE.FIELD [--node N] | "
                              "--top PROBE.FIELD) [--last S] [--format table|jsonl|csv]")
    qu.add_argument("--store", metavar="PATH", action="append", help="the controller's store (default "
                    "/var/lib/jobprobe/controller/store.db); again, or a directory, for several partitions' stores "
                    "read as one")
    qg = qu.add_mutually_exclusive_group(required=True)
    qg.add_argument("--sql", metavar="QUERY")
    qg.add_argument("--job", metavar="ID")
    qg.add_argument("--top", metavar="PROBE.FIELD", help="the nodes with the most of a field over --last (every "
                    "job's samples): the cluster's hottest nodes")
    qu.add_argument("--field", metavar="PROBE.FIELD")
    qu.add_argument("--node", metavar="N")
    qu.add_argument("--level", type=int, choices=[10, 60], help="--field from the rollups of 10 s or 1 min buckets "
                    "(kept a week, 90 days): per bucket n, sum, min, max, mean")
    qu.add_argument("--last", type=float, metavar="S", help="--field, --top: only the last S seconds (--top: "
                    "default 3600); --sql: `samples` and `frames` hold the samples of the last S seconds past the raw "
                    "window too (without it: the raw window's)")
    qu.add_argument("--format", choices=["table", "jsonl", "csv"], default="table")
    qu.add_argument("--summary", action="store_true", help="with --job: the job's cost block (node-hours, GPU-hours, "
                    "energy, waste; money with --prices)")
    qu.add_argument("--prices", metavar="FILE", help="a price file (TOML; see jobprobe/cluster/cost.py)")
    qu.set_defaults(func=cluster.cmd_query)

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
    at.set_defaults(func=node.cmd_attach)
    dt = sub.add_parser("detach", help="ask the agent to detach a job (after a last frame)")
    dt.add_argument("job")
    dt.add_argument("--socket", metavar="PATH", default=None)
    dt.set_defaults(func=node.cmd_detach)
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
    dr.set_defaults(func=node.cmd_doctor)
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
    tr.set_defaults(func=node.cmd_trace)
    st = sub.add_parser("status", help="the agent's jobs, each probe's status per job, the agent's own cost")
    st.add_argument("--json", action="store_true")
    st.add_argument("--socket", metavar="PATH", default=None)
    st.set_defaults(func=node.cmd_status)

    b = sub.add_parser("bench", help="benchmarks: what the probes cost a job")
    b.set_defaults(func=bench.cmd_bench)
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=Parser)
    ov = bsub.add_parser("overhead",
                         help="paired runs of CMD without and with each config; slowdown with 95%% interval",
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

    bi = bsub.add_parser("idle", help="the agent's CPU and RSS with 1, 16, 64, 256 idle jobs and 64 busy ones, "
                         "beside node_exporter's in the same windows (docs/PERFORMANCE.md)")
    bi.add_argument("--jobs", default="1,16,64,256", help="numbers of idle jobs (default 1,16,64,256)")
    bi.add_argument("--busy", type=int, default=64, help="busy jobs after the idle ones (default 64; 0: none)")
    bi.add_argument("--runs", type=int, default=5, help="fresh agents, counts in alternating order (default 5)")
    bi.add_argument("--seconds", type=float, default=20.0, help="each window (default 20)")
    bi.add_argument("--settle", type=float, default=5.0, help="seconds after an attach before a window (default 5)")
    bi.add_argument("--probes", default="std", help="the agent's --probes (default: standard collection)")
    bi.add_argument("--json", metavar="FILE")

    bc = bsub.add_parser("controller", help="one controller against simulated nodes: keeps up at N nodes, its "
                         "ceiling in frames/s per core, a node's bytes on the wire")
    bc.add_argument("--nodes", type=int, default=2000)
    bc.add_argument("--seconds", type=float, default=30.0)
    bc.add_argument("--burst-frames", type=int, default=60_000)
    bc.add_argument("--partitions", type=int, default=1, metavar="N", help="N > 1: N partitions by job, two "
                    "controllers each, the nodes in jobs of 8–512, one active controller SIGKILLed mid-run")
    bc.add_argument("--json", metavar="FILE")

    bst = bsub.add_parser("store", help="the store's queries over a simulated day of a cluster, generated straight "
                          "into its format: a job's field over an hour, the hottest node over an hour")
    bst.add_argument("--nodes", type=int, default=200)
    bst.add_argument("--hours", type=float, default=24.0)
    bst.add_argument("--workdir", metavar="DIR", help="keep the store there (default: a scratch directory, removed)")
    bst.add_argument("--json", metavar="FILE")

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

    bs = bsub.add_parser("stragglers", help="the straggler detector against a fault matrix on a real three-rank DDP "
                         "job: each fault N times at random times and ranks; time to name, right rank and cause, "
                         "false names, precision and recall")
    bs.add_argument("--runs", type=int, default=5, metavar="N", help="trials per fault (default 5)")
    bs.add_argument("--only", action="append", metavar="FAULTS", help="only these faults, separated by commas "
                    "(cpu, neighbour, tbf, loss, imbalance, balanced); repeat")
    bs.add_argument("--seed", type=int)
    bs.add_argument("--json", metavar="FILE")

    rd = sub.add_parser("read", help="decode a frame file (also one whose last frame was cut short)")
    rd.add_argument("file")
    rd.add_argument("--format", choices=["jsonl", "table", "summary"], default="jsonl",
                    help="jsonl: a frame per line; table: a row per sample; summary: per field n/mean/p50/max/sum")
    rd.set_defaults(func=frames.cmd_read)
    rp = sub.add_parser("report", help="one self-contained HTML page of a job: a verdict, per-node timelines, "
                        "stragglers and events",
                        usage="jobprobe report (FILE… | --store PATH --job ID | --store PATH --jobs "
                        "[--since 1d]) -o OUT.html")
    rp.add_argument("files", nargs="*", metavar="FILE", help="frame files (the agents' --out, `run --out`)")
    rp.add_argument("--store", metavar="PATH", action="append", help="the controller's store (with --job); "
                    "again, or a directory, for several partitions' stores")
    rp.add_argument("--job", metavar="ID", help="the job, in the store")
    rp.add_argument("-o", "--out", metavar="HTML", default="report.html")
    rp.add_argument("--prices", metavar="FILE",
                    help="a price file (jobprobe/cluster/cost.py): the job's cost at the top")
    rp.add_argument("--jobs", action="store_true", help="with --store: the page of the jobs that ended in --since "
                    "(`jobprobe jobs` as a page), each name linking its own report, written beside it")
    rp.add_argument("--since", default="1d", help="--jobs: how far back (90s, 30m, 12h, 1d, 2w; default 1d)")
    rp.add_argument("--max-reports", type=int, default=100, metavar="N", help="--jobs: write the reports of the "
                    "newest N jobs (default 100; the others are listed without a link)")
    rp.set_defaults(func=cluster.cmd_report)
    sm = sub.add_parser("summary", help="where a job's wall time went: goodput, the time buckets, its stragglers",
                        usage="jobprobe summary (FILE… | --store PATH --job ID) [--format text|json] "
                        "[--rules FILE]")
    sm.add_argument("files", nargs="*", metavar="FILE", help="frame files (the agents' --out, `run --out`)")
    sm.add_argument("--store", metavar="PATH", action="append", help="the controller's store (with --job); "
                    "again, or a directory, for several partitions' stores")
    sm.add_argument("--job", metavar="ID", help="the job, in the store")
    sm.add_argument("--format", choices=["text", "json"], default="text")
    sm.add_argument("--rules", metavar="FILE|default", help="thresholds of the efficiency notes: the rules file's "
                    "[efficiency] table (default: its shipped values)")
    sm.set_defaults(func=cluster.cmd_summary)
    jb = sub.add_parser("jobs", help="the jobs that ended in a window: owner, nodes, wall, how each ended, goodput, "
                        "largest badput, stragglers", usage="jobprobe jobs --store PATH [--since 1d] "
                        "[--format text|json|csv] [--sort start|wall|goodput|job|badput]")
    store_window(jb, "1d")
    jb.add_argument("--format", choices=["text", "json", "csv"], default="text")
    jb.add_argument("--prices", metavar="FILE", help="a price file (jobprobe/cluster/cost.py): each job's cost")
    jb.add_argument("--sort", choices=["start", "wall", "goodput", "job", "badput"], default="start",
                    help="newest start first (default); wall, badput: largest first; goodput: lowest first")
    jb.set_defaults(func=cluster.cmd_jobs)
    nd = sub.add_parser("nodes", help="the nodes named stragglers in a window, the most time lost to them first; "
                        "suspects: named in job after job", usage="jobprobe nodes --store PATH [--since 7d] "
                        "[--suspect-jobs K] [--format text|json]")
    store_window(nd, "7d")
    nd.add_argument("--suspect-jobs", type=int, default=3, metavar="K", help="a suspect: named in K distinct jobs "
                    "(default 3)")
    nd.add_argument("--format", choices=["text", "json"], default="text")
    nd.set_defaults(func=cluster.cmd_nodes)
    return p


def store_window(p: argparse.ArgumentParser, since: str) -> None:
    """--store (one or more) and --since: the window of a store's events a listing reads (jobs, nodes)."""
    p.add_argument("--store", metavar="PATH", action="append", required=True, help="the controller's store; "
                   "again, or a directory, for several partitions' stores")
    p.add_argument("--since", default=since, help=f"how far back (90s, 30m, 12h, 1d, 2w; default {since})")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv cut at its first `--`: (jobprobe's own arguments, CMD ARGS...). Done before argparse sees argv, because
    holding CMD in argparse needs a catch-all positional on `run` and on each `bench` subcommand, which would also
    take a command given without `--` (`jobprobe run sleep 1` is refused), would leave the other commands to refuse
    `-- CMD` with argparse's "unrecognized arguments" instead of main()'s own line, and would strip `--`
    differently from one Python version to another (a `--` inside CMD ARGS reaches CMD as it is)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def toggles_as_options(argv: list[str]) -> list[str]:
    """`jobprobe probes --job JOB -sched,+perf`: a toggle that starts with '-' is a value, but argparse would take it
    for an unknown option (it has no way to mark a positional as accepting one). Each such word, '+x' too, becomes
    --toggle=WORD, which the probes subcommand reads as its hidden --toggle."""
    if argv[:1] == ["probes"] and "--job" in argv:
        return [f"--toggle={a}" if a[:1] in "+-" and a[1:2].isalpha() else a for a in argv]
    # `--probes -perf` (run, agent, attach): the same, for an option's value — argparse wants `--probes=-perf`
    out: list[str] = []
    for a in argv:
        if out and out[-1] == "--probes" and a[:1] == "-" and a[1:2].isalpha():
            out[-1] = f"--probes={a}"
        else:
            out.append(a)
    return out


def _partition(text: str) -> tuple[int, int]:
    """--partition I/N → (I, N)."""
    i, sep, n = text.partition("/")
    if not (sep and i.isascii() and i.isdigit() and n.isascii() and n.isdigit() and 0 <= int(i) < int(n) <= 1024):
        raise argparse.ArgumentTypeError(f"{text!r}: give I/N, 0 ≤ I < N ≤ 1024 (e.g. 0/4)")
    return int(i), int(n)
