# SPDX-License-Identifier: Apache-2.0
"""The node's commands: run (one job in the foreground), agent (the node daemon), the agent's clients over its
control socket (attach, detach, status, probes --job, trace), probes (the list: what can run here) and doctor (is
this node ready). Each command imports what it drives inside its function, so that a command pulls in only its
own part of jobprobe."""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import threading
import time

from jobprobe.core.errors import BadInput
from jobprobe.kernel.host import Host


# ---- the agent's control socket ----------------------------------------------------------------------------------
def socket_path(args) -> str:
    from jobprobe.node.config import Config
    return args.socket or os.environ.get("JOBPROBE_SOCKET") or Config.socket


def client_call(args, req: dict) -> dict:
    from jobprobe.node.control import call
    reply = call(socket_path(args), req)
    if not reply.get("ok"):
        raise BadInput(reply.get("error") or "the agent refused")
    return reply


# ---- probes ------------------------------------------------------------------------------------------------------
def cmd_probes(args) -> int:
    """Without --job: every probe, can it run here. With --job JOB +x,-y: switch that job's probes in the agent."""
    args.toggle = args.toggle or args.toggle_opt
    if args.job or args.toggle:
        if not (args.job and args.toggle):
            raise BadInput("give both: jobprobe probes --job JOB +x,-y")
        r = client_call(args, {"cmd": "probes", "job": args.job, "toggle": args.toggle})
        print("\n".join(f"{r['job']}: {n} {st}" for n, st in r["probes"].items()))
        return 0
    return list_probes(args, Host())


def list_probes(args, host: Host) -> int:
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


# ---- run ---------------------------------------------------------------------------------------------------------
def make_target(args, command: list[str]):
    from jobprobe.node.targets.cgroup import CgroupTarget
    from jobprobe.node.targets.command import CommandTarget
    from jobprobe.node.targets.k8s import k8s_pod_target
    from jobprobe.node.targets.pidtree import PidTreeTarget
    from jobprobe.node.targets.slurm import slurm_target
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


def cmd_run(args) -> int:
    """The agent with one job, in the foreground: the same job table, tick and sinks as `jobprobe agent`."""
    from jobprobe.exporters.file import FileSink
    from jobprobe.exporters.queued import QueuedSink
    from jobprobe.exporters.stdout import StdoutSink
    from jobprobe.node.agent import Agent
    from jobprobe.node.config import Config
    from jobprobe.node.registry import all_probes, parse_probes
    from jobprobe.node.targets.command import CommandTarget

    host = Host()
    if args.interval <= 0:
        raise BadInput(f"--interval must be positive, got {args.interval}")
    reg = all_probes()
    names = parse_probes(args.probes, reg)
    if not host.is_root:
        need = [n for n in names if reg[n].needs_root]
        if need:
            raise BadInput(f"not root: probes {', '.join(need)} need root (BPF, perf_event on cgroups); "
                           f"run as root or choose --probes {','.join(n for n in names if n not in need) or 'self'}")
    target = make_target(args, args.command)
    sinks: list = []
    agent = None
    try:
        if args.out:
            try:
                sinks.append(QueuedSink(FileSink(args.out, args.out_max_mb), "file"))
            except OSError as err:
                raise BadInput(f"cannot write {args.out}: {err.strerror}") from err
        if args.stdout or not args.out:
            sinks.append(QueuedSink(StdoutSink(args.stdout or "human"), "stdout"))
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


# ---- agent -------------------------------------------------------------------------------------------------------
def check_dirs(cfg) -> None:
    """The directories the agent writes in, checked now (jobprobe/core/safefile.py; a refusal is the CLI's one line,
    exit 2) rather than at a job's attach: --out (may be shared, like /tmp), the state file's directory, the spool."""
    from jobprobe.core.safefile import Dir
    if cfg.out:
        Dir(cfg.out, shared=True).close()
    Dir(os.path.dirname(os.path.abspath(cfg.state)), narrow=False).close()
    if cfg.nats:
        Dir(cfg.spool).close()


def cmd_agent(args) -> int:
    from jobprobe.node.agent import Agent
    from jobprobe.node.config import DEFAULT_CONFIG, Config
    from jobprobe.node.control import ControlServer
    host = Host()
    if not host.is_root:
        raise BadInput("not root: the agent loads eBPF programs and serves a root-only socket; run it as root")
    from jobprobe.core.libc import lean_heap
    lean_heap()                 # before the agent's threads: one malloc arena (docs/ARCHITECTURE.md, "Memory")
    cfg = Config.load(args.config or DEFAULT_CONFIG,
                      {"interval": args.interval, "probes": args.probes, "out": args.out,
                       "out_max_mb": args.out_max_mb, "stdout": args.stdout, "socket": args.socket,
                       "state": args.state, "attach_wait": args.attach_wait, "queue": args.queue,
                       "slurm": args.slurm, "slurm_node": args.slurm_node, "k8s": args.k8s,
                       "k8s_every": args.k8s_every, "k8s_token_file": args.k8s_token_file, "k8s_ca": args.k8s_ca,
                       "k8s_insecure": args.k8s_insecure, "k8s_node": args.k8s_node, "k8s_labels": args.k8s_labels,
                       "nats": args.send, "spool": args.spool,
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
    check_dirs(cfg)
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
                                 ca_file=cfg.k8s_ca, insecure=cfg.k8s_insecure, node=cfg.k8s_node,
                                 labels=tuple(k.strip() for k in cfg.k8s_labels.split(",") if k.strip()))
            watcher.start()
        agent.run()
    finally:
        if watcher is not None:
            watcher.stop()
        server.close()
        agent.close()
    return 0


# ---- the agent's clients, doctor ---------------------------------------------------------------------------------
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
    from jobprobe.core.frame import FrameBuilder, encode
    from jobprobe.core.wire import frames_subject, inbox_prefix, msg_id
    from jobprobe.transport.credentials import NatsError
    from jobprobe.transport.natswire import Wire
    fr = FrameBuilder(node, "node", f"doctor-{int(time.time() * 1000)}").event(time.time(), "doctor", **result)
    try:
        wire = Wire(args.controller, args.nats_creds, args.nats_ca, name="jobprobe-doctor", inbox=inbox_prefix(node))
    except (OSError, ValueError) as err:
        raise BadInput(f"doctor: --nats-creds: {err}") from None
    try:
        wire.connect()
        wire.publish([(frames_subject(node, fr["job"]), msg_id(fr), encode(fr))], timeout=10)
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

