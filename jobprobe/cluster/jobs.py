# SPDX-License-Identifier: Apache-2.0
"""The operator's table of the day's jobs: `jobprobe jobs --store PATH [--since 1d] [--format text|json|csv]`.

One row per job whose `summary` event (made by the controller when the job's last node let it go:
jobprobe/cluster/summary.py) falls in the window — its newest, where the job ended more than once: who it was
(its owner labels: the scheduler's user, account, partition… or attach's `--label`, from its frames), on how many
nodes, when it started, its wall time, how it ended (exit code or signal; `failed`), its goodput, its largest
badput bucket, the stragglers named in it and how often it was started again. Jobs still running have no summary
yet and are not listed.
"""
from __future__ import annotations

import csv
import io
import json
import re
import time
from typing import Any

from jobprobe.core.errors import BadInput

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
COLUMNS = ("job", "owner", "nodes", "start", "wall_s", "end", "failed", "goodput", "badput", "badput_s",
           "stragglers", "restarts")
SORTS = ("start", "wall", "goodput", "job", "badput")


def parse_since(text: str) -> float:
    """'90s', '30m', '12h', '1d', '2w' → seconds; anything else is BadInput."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([smhdw])", text.strip())
    if not m or float(m.group(1)) <= 0:
        raise BadInput(f"--since {text!r}: expected a length of time like 90s, 30m, 12h, 1d or 2w")
    return float(m.group(1)) * UNITS[m.group(2)]


def rows(store: Any, since_s: float, now: float | None = None, sort: str = "start",
         prices: Any = None) -> list[dict[str, Any]]:
    """The jobs whose summary came within `since_s` of `now`, a dict each (COLUMNS), sorted (newest start first;
    wall, badput: largest first; goodput: lowest first; job: by name). With `prices` (cost.load), each row's cost
    (`cost`, `currency`) from the job's samples (jobprobe/cluster/cost.py); None where no price matched its nodes."""
    now = time.time() if now is None else now
    newest: dict[str, tuple[float, dict]] = {}
    for job, t, body in store.sql("SELECT job, t, body FROM events WHERE event = 'summary' AND t >= ? ORDER BY t",
                                  (now - since_s,))[1]:
        try:
            s = json.loads(body)
        except ValueError:
            continue
        if isinstance(s, dict) and "skipped" not in s:
            newest[job] = (t, s)
    out = [row(job, s, owner(store, job)) for job, (_, s) in newest.items()]
    if prices is not None:
        from jobprobe.cluster import cost
        for r in out:
            try:
                c = cost.summary(store, r["job"], prices)
            except BadInput:            # no samples kept (past retention)
                c = {}
            r["cost"] = round(c["cost"], 2) if "cost" in c and len(c.get("unpriced_nodes") or ()) < len(
                c.get("nodes") or ()) else None
            r["currency"] = prices.currency
    key = {"start": lambda r: -(r["start"] or 0.0), "wall": lambda r: -r["wall_s"], "goodput": lambda r: r["goodput"],
           "job": lambda r: r["job"], "badput": lambda r: -r["badput_s"]}[sort]
    return sorted(out, key=key)


def owner(store: Any, job: str) -> dict[str, str]:
    """The job's labels (its newest frame that has them): who it was."""
    got = store.sql("SELECT json_extract(body, '$.labels') FROM frames WHERE job = ? AND "
                    "json_extract(body, '$.labels') IS NOT NULL ORDER BY t DESC LIMIT 1", (job,))[1]
    try:
        labels = json.loads(got[0][0]) if got else {}
    except (TypeError, ValueError):
        return {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def row(job: str, s: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    buckets = s.get("buckets") or {}
    bad = max(((b, v) for b, v in buckets.items() if b != "computing"), key=lambda bv: bv[1], default=("", 0.0))
    ended = s.get("ended") or {}
    return {"job": job, "owner": labels, "nodes": s.get("nodes", 0), "start": s.get("start"),
            "wall_s": s.get("wall_s", 0.0), "end": ended.get("how", "") if ended else "",
            "failed": bool(ended) and not ended.get("ok", True), "goodput": s.get("goodput", 0.0),
            "badput": bad[0] if bad[1] > 0 else "", "badput_s": round(bad[1], 3),
            "stragglers": sorted({p.get("node", "") for p in s.get("stragglers") or []}),
            "restarts": s.get("restarts", 0)}


def _owner_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


def text(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "no job ended in the window\n"
    head = f"{'job':<28} {'owner':<32} {'nodes':>5} {'start':<19} {'wall':>9} {'end':<25} {'goodput':>7}  " \
           f"{'largest badput':<26} stragglers"
    priced = any("cost" in r for r in rs)
    if priced:
        head += f"  {'cost':>10}"
    lines = [head]
    for r in rs:
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["start"])) if r["start"] else "-"
        end = (r["end"] or "-") + (" FAILED" if r["failed"] else "")
        bad = f"{r['badput']} {r['badput_s']:.0f} s" if r["badput"] else "-"
        lines.append(f"{r['job'][:28]:<28} {_owner_text(r['owner'])[:32]:<32} {r['nodes']:>5} {start:<19} "
                     f"{r['wall_s']:>8.0f}s {end:<25} {100 * r['goodput']:>6.0f}%  {bad[:26]:<26} "
                     f"{','.join(r['stragglers']) or '-'}" +
                     (f"  {cost_text(r):>10}" if priced else ""))
    failed = sum(r["failed"] for r in rs)
    lines.append(f"{len(rs)} job{'s' if len(rs) != 1 else ''}, {failed} failed")
    return "\n".join(lines) + "\n"


def cost_text(r: dict[str, Any]) -> str:
    return "-" if r.get("cost") is None else f"{r['cost']:,.2f} {r.get('currency', '')}".strip()


def as_csv(rs: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    cols = COLUMNS + (("cost", "currency") if any("cost" in r for r in rs) else ())
    w.writerow(cols)
    for r in rs:
        w.writerow([_owner_text(r["owner"]) if c == "owner" else ";".join(r[c]) if c == "stragglers" else r.get(c)
                    for c in cols])
    return buf.getvalue()


def page_name(job: str) -> str:
    """A job's report's file name beside the jobs page: its name made safe for a file (a job's name is its owner's
    to write: slashes, dots, anything), with a short hash so that two names made alike stay apart."""
    import hashlib
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", job)[:80]
    return f"{safe}-{hashlib.sha256(job.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}.html"


def html(rs: list[dict[str, Any]], since: str, linked: set[str]) -> str:
    """The jobs as one self-contained page: a row each, its name linking to its report where one was written."""
    from html import escape
    priced = any("cost" in r for r in rs)
    cols = ["job", "owner", "nodes", "start", "wall", "end", "goodput", "largest badput", "stragglers"] + \
        (["cost"] if priced else [])
    body = []
    for r in rs:
        name = escape(r["job"])
        cell = f'<a href="{escape(page_name(r["job"]))}">{name}</a>' if r["job"] in linked else name
        start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["start"])) if r["start"] else "-"
        bad = f"{r['badput']} {r['badput_s']:.0f} s" if r["badput"] else "-"
        vals = [cell, escape(_owner_text(r["owner"])), str(r["nodes"]), start, f"{r['wall_s']:.0f} s",
                escape(r["end"] or "-") + (" <b>FAILED</b>" if r["failed"] else ""), f"{100 * r['goodput']:.0f}%",
                escape(bad), escape(", ".join(r["stragglers"]) or "-")] + ([escape(cost_text(r))] if priced else [])
        body.append("<tr" + (' class="failed"' if r["failed"] else "") + ">" +
                    "".join(f"<td>{v}</td>" for v in vals) + "</tr>")
    failed = sum(r["failed"] for r in rs)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>jobprobe: jobs of the last "
            f"{escape(since)}</title><style>body{{font-family:sans-serif}}table{{border-collapse:collapse}}"
            "td,th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:left}tr.failed td{background:#fdd}"
            f"</style></head><body><h1>Jobs that ended in the last {escape(since)}</h1>"
            f"<p>{len(rs)} job{'s' if len(rs) != 1 else ''}, {failed} failed. Each name opens its report.</p>"
            "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + "".join(body) +
            "</table></body></html>\n")
