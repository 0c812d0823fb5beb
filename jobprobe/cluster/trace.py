# SPDX-License-Identifier: Apache-2.0
"""Cluster-wide deep traces: the controller's answer to `jobprobe trace --job ID --nats URL [--at T]`.

The request comes as a core NATS request on jobprobe.ctl.trace (jobprobe/cluster/ingest.py subscribes it). The
controller asks every node that sent frames of the job in the last 30 s (jobprobe.ctl.node.<node>, answered by that
node's agent) to open a window at one common time — T, or TRACE_LEAD_S from now — and answers with each node's
reply. Each node writes its own file and announces it in a `trace` frame, which reaches the store.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Protocol

from jobprobe.core.numbers import is_finite
from jobprobe.core.wire import control_subject

log = logging.getLogger("jobprobe.cluster.trace")

TRACE_LEAD_S = 3.0      # a cluster-wide trace starts this far ahead: every node has its request by then
TRACE_ASK_S = 5.0       # how long a node has to answer


class NodeState(Protocol):
    """What this module reads of the controller's view of a node (controller.NodeState is one): whether it is lost
    (0: not; else when), and when each of its jobs was last seen."""
    lost: float
    jobs: dict[str, float]


def nodes_of(nodes: dict[str, "NodeState"], job: str, now: float) -> list[str]:
    """The nodes that sent frames of `job` lately (within 30 s) and are not lost."""
    return sorted(n for n, st in nodes.items() if not st.lost and now - st.jobs.get(job, -1e18) < 30)


async def cluster_trace(nodes: dict[str, "NodeState"], nc: Any, req: dict) -> dict:
    """Ask every node of the job to open a window at one common time `at` (default now + TRACE_LEAD_S, so that
    every request is there before it); each node's answer, or why it did not answer."""
    now = time.time()
    job, duration = req.get("job"), req.get("duration", 25.0)
    if not isinstance(job, str) or not job:
        return {"ok": False, "error": "give the job's name"}
    names = nodes_of(nodes, job, now)
    if not names:
        return {"ok": False, "error": f"no node has sent frames of job {job!r} in the last 30 s"}
    at = req.get("at")
    at = now + TRACE_LEAD_S if at is None else at
    if not is_finite(at) or at < now:
        return {"ok": False, "error": f"at {at!r} is past (now {now:.1f}): give a time ahead, or none"[:200]}
    if not is_finite(duration) or duration <= 0:
        return {"ok": False, "error": f"duration {duration!r} is not a number of seconds > 0"[:200]}
    ask = json.dumps({"cmd": "trace", "job": job, "duration": duration, "at": at}).encode()

    async def one(node: str) -> dict:
        try:
            msg = await nc.request(control_subject(node), ask, timeout=TRACE_ASK_S)
            got = json.loads(msg.data)
        except Exception as err:          # no agent listening, a timeout, not JSON: said per node
            return {"ok": False, "error": f"{type(err).__name__}: {err}"[:200]}
        return got if isinstance(got, dict) else {"ok": False, "error": "its answer is not a JSON object"}
    answers = await asyncio.gather(*(one(n) for n in names))
    log.warning("job %s: trace at %.3f on %d nodes: %s", job, at, len(names),
                {n: a.get("state") or a.get("error") for n, a in zip(names, answers)})
    return {"ok": any(a.get("ok") and a.get("state") in ("scheduled", "tracing") for a in answers),
            "job": job, "at": at, "duration_s": duration, "nodes": dict(zip(names, answers))}


async def answer(nodes: dict[str, "NodeState"], nc: Any, msg: Any, mine: Any = lambda job: True) -> None:
    """One request on jobprobe.ctl.trace: its JSON asked of the nodes (cluster_trace), the outcome the reply. A
    request for a job that is not `mine` (another partition's) is left to its controller."""
    try:
        req = json.loads(msg.data)
        job = req.get("job") if isinstance(req, dict) else None
        if isinstance(job, str) and job and not mine(job):
            return
        out = await cluster_trace(nodes, nc, req if isinstance(req, dict) else {})
    except ValueError as err:
        out = {"ok": False, "error": f"not JSON: {err}"}
    if msg.reply:
        await msg.respond(json.dumps(out).encode())
