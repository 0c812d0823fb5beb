# SPDX-License-Identifier: Apache-2.0
"""The cluster's commands: controller (run: frames from NATS JetStream into the store; stats: freshness and delivery
per node; enroll NODE: a node's NATS credentials), query (the store: SQL, one field of a job, its cost) and report
(one HTML page of a job, from frame files or the store). The controller's NATS client (nats-py) and matplotlib are
imported inside the commands that need them, never by the node's commands."""
from __future__ import annotations

import json
import os
import signal
import sys

from jobprobe.core.errors import BadInput
from jobprobe.core.frame import MalformedFrame, StreamReader


def cmd_controller(args) -> int:
    """`jobprobe controller [run|stats|enroll|tls|mappings]`: each action its own function."""
    try:
        import jobprobe.cluster.controller  # noqa: F401 (its packages: nats-py, numpy)
    except ImportError as err:     # a node-only install: the controller's packages are an extra
        raise BadInput(f"controller: {err.name or err} is not installed here (a node-only install): install "
                       "jobprobe[controller] (docs/DEPLOY.md)") from None
    if args.action == "enroll":
        return controller_enroll(args)
    if args.action == "tls":
        return controller_tls(args)
    if args.action == "mappings":
        from jobprobe.core.wire import mappings_conf
        print(mappings_conf(args.partition[1]), end="")
        return 0
    if args.node:
        raise BadInput(f"controller {args.action}: takes no node name (did you mean `controller enroll NODE`?)")
    if args.action == "stats":
        return controller_stats(args)
    return controller_run(args)


def controller_stats(args) -> int:
    """Per node: frames, duplicates, refusals, freshness, delay, gaps, drops, clock; doctors not passing."""
    from jobprobe.cluster.metrics import stats
    from jobprobe.cluster.store import Store
    try:
        st = stats(Store(args.store or os.path.join(args.data, "store.db"), readonly=True))
    except FileNotFoundError as err:
        raise BadInput(str(err)) from None
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"{'node':<20} {'frames':>8} {'dup':>5} {'rej':>5} {'newest age s':>13} {'delay p50/p99 s':>16} "
          f"{'longest gap s':>14} {'dropped':>8} {'missing':>8} {'clock s':>8}")
    for node, n in sorted(st["nodes"].items()):
        d = n.get("arrival_delay_s") or {}
        print(f"{node:<20} {n.get('frames', 0):>8} {n.get('duplicates', 0):>5} {n.get('rejected', 0):>5} "
              f"{n.get('newest_sample_age_s')!s:>13} {str(d.get('median')) + '/' + str(d.get('p99')):>16} "
              f"{n.get('longest_gap_s')!s:>14} {n.get('dropped_at_source', 0):>8} {n.get('missing_frames', 0):>8} "
              f"{(n.get('clock') or {}).get('offset_s', '')!s:>8}")
    for node, n in sorted(st["nodes"].items()):
        doc = n.get("doctor")
        if doc and doc["worst"] != "pass":
            print(f"{node}: doctor {doc['worst']}" + (f" ({', '.join(doc['not_pass'])})" if doc["not_pass"]
                                                      else "") + (" — NOT READY" if doc["worst"] == "fail" else ""))
    return 0


def controller_run(args) -> int:
    """The controller: its nats-server (unless --nats), the store, ingestion until SIGINT/SIGTERM."""
    import asyncio

    from jobprobe.cluster import jobs
    from jobprobe.cluster.controller import Controller
    from jobprobe.cluster.natsserver import LocalNats
    from jobprobe.cluster.store import Store
    path = args.store or os.path.join(args.data, "store.db")
    if not (args.raw_minutes >= 0 and args.stream_hours > 0):
        raise BadInput("--raw-minutes: 0 or more; --stream-hours: more than 0")
    from jobprobe.cluster.quota import Limits
    limits = Limits.parse(args.quota)     # a bad quota: one line, before anything starts
    if args.prices:
        from jobprobe.cluster.cost import load as load_prices
        load_prices(args.prices)         # a bad price file: one line, before anything starts
    local = None
    url = args.nats
    creds = args.creds
    if url is None:
        local = LocalNats(args.data, args.listen, args.tls_cert, args.tls_key, args.insecure_plaintext,
                          partitions=args.partition[1])
        local.wait()
        url, creds = local.url, creds or local.creds
    elif args.tls_cert or args.insecure_plaintext:
        raise BadInput("--tls-cert and --insecure-plaintext are for the nats-server the controller starts (no --nats)")
    if args.suspect_jobs < 0:
        raise BadInput("--suspect-jobs: 0 (never) or more")
    suspect_window = jobs.parse_since(args.suspect_window)    # a bad length: one line, exit 2
    store = Store(path)
    ctl = Controller(store, url, retention_s=args.retention_days * 86400, creds=creds, ca=args.ca,
                     replicas=args.replicas, tsdb=args.tsdb, prices=args.prices, part=args.partition,
                     raw_s=args.raw_minutes * 60, stream_s=args.stream_hours * 3600, limits=limits,
                     suspect_jobs=args.suspect_jobs, suspect_window_s=suspect_window)
    if local is not None:
        local.supervise()          # from now on a server that exits is started again (natsserver.py)
        ctl.server = local
    server = None
    if args.metrics:
        from jobprobe.cluster.metrics import serve_metrics
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
    from jobprobe.cluster.natsserver import write_auth
    from jobprobe.transport.natsauth import Auth, reload_server
    if len(args.node) != 1:
        raise BadInput("controller enroll: give one node's name (its agent's --node)")
    node = args.node[0]
    auth = Auth(args.data)
    auth.controller_seed()
    path = auth.enroll(node)
    write_auth(args.data)
    pid = reload_server(args.data)
    print(f"enrolled {node}: " + (f"the running nats-server (pid {pid}) reloaded its users" if pid else
                                       "no nats-server runs for this data directory; the next start admits it"))
    print(path)
    return 0


def controller_tls(args) -> int:
    """A CA (once) and the nats-server's certificate for the names given; the flags that use them."""
    from jobprobe.cluster import tls
    made = tls.make(args.data, args.node)
    print(f"controller: jobprobe controller --data {args.data} --listen 0.0.0.0:4222 --tls-cert {made['cert']} "
          f"--tls-key {made['key']} --ca {made['ca']}")
    print(f"each agent (copy {made['ca']} to it): jobprobe agent --send tls://{args.node[0]}:4222 "
          f"--nats-ca {made['ca']} --nats-creds …")
    print(made["ca"])
    return 0


def cmd_report(args) -> int:
    import importlib.util

    from jobprobe.cluster import report
    if importlib.util.find_spec("matplotlib") is None:
        raise BadInput("report: needs matplotlib (pip install 'jobprobe[report]')")
    from jobprobe.cluster import summary
    if args.jobs:
        return jobs_page(args)
    frames = _job_frames("report", args)
    job = report.Job(args.job or "")
    job.take(frames)
    job.sort()
    cost = None
    if args.prices:
        from jobprobe.cluster import cost as _cost
        prices = _cost.load(args.prices)
        cost = _cost.summary(_store_of(args.store, args.files), job.name, prices)
    size = report.write(job, args.out, cost, summary.html_table(summary.summarize(frames, job.name)))
    print(f"{args.out}: {job.name}, {len(job.nodes)} node(s), {size / 1024:.0f} KiB")
    return 0


def jobs_page(args) -> int:
    """`report --jobs`: the jobs that ended in the window as a page, the newest --max-reports with their reports
    beside it (each as `report --store … --job J` writes it)."""
    import sqlite3

    from jobprobe.cluster import cost as _cost
    from jobprobe.cluster import jobs, report, summary
    since = jobs.parse_since(args.since)
    if not args.store or args.files or args.job:
        raise BadInput("report --jobs: give --store PATH (and no --job or frame files)")
    prices = _cost.load(args.prices) if args.prices else None
    try:
        store = _store_of(args.store, [])
        rs = jobs.rows(store, since, prices=prices)
    except (OSError, ValueError, sqlite3.Error) as err:
        raise BadInput(f"report --jobs: {' '.join(args.store)}: {err}") from None
    out_dir = os.path.dirname(os.path.abspath(args.out))
    linked = set()
    for r in rs[:max(0, args.max_reports)]:          # newest first
        frames = summary.frames_of_store(args.store, r["job"])
        job = report.Job(r["job"])
        job.take(frames)
        job.sort()
        c = _cost.summary(store, r["job"], prices) if prices else None
        report.write(job, os.path.join(out_dir, jobs.page_name(r["job"])), c,
                     summary.html_table(summary.summarize(frames, r["job"])))
        linked.add(r["job"])
    with open(args.out, "w") as f:
        f.write(jobs.html(rs, args.since, linked))
    print(f"{args.out}: {len(rs)} job(s), {len(linked)} report(s) beside it")
    return 0


def cmd_summary(args) -> int:
    from jobprobe.cluster import summary
    from jobprobe.core import efficiency
    th = efficiency.load(args.rules)       # a bad rules file: one line, before anything is read
    frames = _job_frames("summary", args)
    s = summary.summarize(frames, args.job or "", th)
    if not s["nodes"]:
        raise BadInput(f"summary: no sample frames of {'job ' + args.job if args.store else 'the files given'}")
    print(json.dumps(s, indent=1) if args.format == "json" else summary.text(s), end="\n" if args.format == "json"
          else "")
    return 0


def cmd_jobs(args) -> int:
    import sqlite3

    from jobprobe.cluster import jobs
    from jobprobe.cluster.store import Store
    since = jobs.parse_since(args.since)          # a bad window: one line, before anything is read
    prices = None
    if args.prices:
        from jobprobe.cluster import cost
        prices = cost.load(args.prices)            # a bad price file: one line, before anything is read
    try:
        rs = jobs.rows(Store(args.store, readonly=True), since, sort=args.sort, prices=prices)
    except (OSError, ValueError, sqlite3.Error) as err:     # not there, not a store
        raise BadInput(f"jobs: {' '.join(args.store)}: {err}") from None
    print(json.dumps(rs, indent=1) if args.format == "json" else jobs.as_csv(rs) if args.format == "csv"
          else jobs.text(rs), end="\n" if args.format == "json" else "")
    return 0


def cmd_nodes(args) -> int:
    import sqlite3

    from jobprobe.cluster import jobs, nodes
    from jobprobe.cluster.store import Store
    since = jobs.parse_since(args.since)          # a bad window: one line, before anything is read
    if args.suspect_jobs < 1:
        raise BadInput("--suspect-jobs: at least 1")
    try:
        rs = nodes.rows(Store(args.store, readonly=True), since, min_jobs=args.suspect_jobs)
    except (OSError, ValueError, sqlite3.Error) as err:     # not there, not a store
        raise BadInput(f"nodes: {' '.join(args.store)}: {err}") from None
    print(nodes.as_json(rs) if args.format == "json" else nodes.text(rs), end="\n" if args.format == "json" else "")
    return 0


def _job_frames(cmd: str, args) -> list[dict]:
    """One job's frames: from frame files, or from the store with --job (a clear error for each way it fails)."""
    from jobprobe.cluster import report, summary
    if bool(args.files) == bool(args.store):
        raise BadInput(f"{cmd}: give frame files, or --store PATH --job ID")
    if args.store:
        if not args.job:
            raise BadInput(f"{cmd}: --store needs --job ID")
        import sqlite3
        try:
            return summary.frames_of_store(args.store, args.job)
        except (OSError, ValueError, sqlite3.Error) as err:     # not there, not a store
            raise BadInput(f"{cmd}: {' '.join(args.store)}: {err}") from None
    for f in args.files:
        if not os.path.isfile(f):
            raise BadInput(f"{cmd}: no frame file {f}")
    out = []
    for f in args.files:         # one at a time: an error names its file
        try:
            out += report.frames_of_files([f])
        except MalformedFrame as err:
            raise BadInput(f"{cmd}: {f}: not a frame file: {err}") from None
        except OSError as err:
            raise BadInput(f"{cmd}: {f}: {err.strerror or err}") from None
    return out


def _store_of(path: str | None, files: list[str]):
    """The controller's store, or an in-memory one made of frame files."""
    from jobprobe.cluster.store import Store
    if path:
        return Store(path, readonly=True)
    st = Store(":memory:")
    for f in files:
        try:
            with open(f, "rb") as fp:
                st.add(list(StreamReader(fp)))
        except (MalformedFrame, OSError) as err:
            raise BadInput(f"{f}: not a frame file: {err}") from None
    return st


def cmd_query(args) -> int:
    import csv
    import sqlite3

    from jobprobe.cluster.store import Store
    try:
        store = Store(args.store or ["/var/lib/jobprobe/controller/store.db"], readonly=True)
    except (FileNotFoundError, ValueError, sqlite3.Error) as err:
        raise BadInput(f"query: {err}") from None
    if args.summary or args.prices:
        from jobprobe.cluster import cost
        if not args.job:
            raise BadInput("--summary needs --job ID")
        try:
            s = cost.summary(store, args.job, cost.load(args.prices) if args.prices else None)
        except sqlite3.Error as err:          # a file that is not a store
            raise BadInput(f"query: {err}") from None
        print(json.dumps(s, indent=1) if args.format == "jsonl" else cost.text(s))
        return 0
    try:
        import time
        since = time.time() - args.last if args.last else float("-inf")
        if args.sql:
            if args.last:           # compacted samples of that window in the SQL face too
                store.expand(since)
            cols, rows = store.sql(args.sql)
        elif args.top:
            cols, rows = store.top(args.top, time.time() - (args.last or 3600.0))
        else:
            if not args.field:
                raise BadInput("--job needs --field PROBE.FIELD (e.g. cgroup.cpu_user_ns)")
            if args.level:
                cols, rows = store.rolled(args.job, args.field, args.level, args.node, since)
            else:
                cols, rows = store.field(args.job, args.field, args.node, since)
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

