# SPDX-License-Identifier: Apache-2.0
"""How a job ended: the `end` record of its last sample frame (docs/FRAMES.md), read the same way by the agent that
writes it, the controller and the command line that read it.

`end` = {"why": text, "cause": one of CAUSES, "exit_code": 0..255 | "signal": 1..127, "oom_kills": n,
"scheduler": text}; every key but `why` optional (frames of older agents carry only why and the code). `scheduler` is
what the job's scheduler said of it as it ended (SLURM's state and reason), where that names a cause.
"""
from __future__ import annotations

import signal as _signal
from typing import Any

# cause → what it says, and whether it is a bad end where no code says otherwise
CAUSES = {
    "exit": "its lead process exited",                                   # exit_code says how
    "signal": "its lead process was killed by a signal",
    "oom_kill": "the OOM killer took a process of the job",
    "group_removed": "its group was removed under it",
    "exited": "every process exited, how is not known",                # no exit record (not root, no taskstats)
    "no_process": "no process ever ran in it",
    "node_lost": "the controller lost its node (said by the controller, never by an agent)",
    # the scheduler's word, where it ended the job (its lead's exit_code/signal kept beside)
    "timeout": "the scheduler ended it at its time limit",
    "requeued": "the scheduler stopped it to run it again (a requeue; a preemption that requeues)",
    "preempted": "the scheduler stopped it for another job",
    "node_fail": "the scheduler ended it for its node's failure",
    "evicted": "the node's kubelet or the API evicted it (node pressure, a drain, a taint)",
}
MAX_SCHEDULER = 120     # characters of the scheduler's words kept
BAD = {"signal", "oom_kill", "node_lost", "timeout", "requeued", "preempted", "node_fail", "evicted"}
# the causes a scheduler's own word may give (SLURM's state, a pod's status: OOMKilled is the kubelet's word too)
SCHEDULER = ("timeout", "requeued", "preempted", "node_fail", "evicted", "oom_kill")


def failed(end: Any) -> bool:
    """Whether a last frame's `end` says the job ended badly: an exit code other than 0, a signal, an OOM kill."""
    if not isinstance(end, dict):
        return False
    code, sig = end.get("exit_code"), end.get("signal")
    return (isinstance(code, int) and code != 0) or isinstance(sig, int) or end.get("cause") in BAD


def cause_of(end: dict) -> str:
    """`end`'s cause, also for a record from before `cause`: from its code."""
    cause = end.get("cause")
    if cause in CAUSES:
        return str(cause)
    return "signal" if isinstance(end.get("signal"), int) else "exit" if isinstance(end.get("exit_code"), int) \
        else "exited"


def signame(n: int) -> str:
    try:
        return _signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def how(end: dict) -> str:
    """One short phrase: `exit 0`, `exit 3`, `SIGKILL`, `OOM kill (SIGKILL)`, `group removed (exit 0)`, `exited`."""
    code, sig = end.get("exit_code"), end.get("signal")
    status = f"exit {code}" if isinstance(code, int) else signame(sig) if isinstance(sig, int) else ""
    cause = cause_of(end)
    if cause in ("exit", "signal"):
        return status
    words = {"oom_kill": "OOM kill", "group_removed": "group removed", "exited": "exited",
             "no_process": "no process", "node_lost": "node lost", "timeout": "time limit", "requeued": "requeued",
             "preempted": "preempted", "node_fail": "node failure", "evicted": "evicted"}[cause]
    return f"{words} ({status})" if status else words


def record(why: str, status: dict[str, int], removed: bool, never_ran: bool,
           scheduler: dict[str, str] | None = None) -> dict[str, Any]:
    """The `end` record as the agent knows it: why (text), its cause, the lead's status where known. `scheduler`
    ({"cause": one of SCHEDULER, "scheduler": its words}) is the scheduler's cause, which comes first: a job at its
    time limit is killed by a signal, and that signal is how, not why."""
    cause = "group_removed" if removed else "signal" if "signal" in status else "exit" if status else \
        "no_process" if never_ran else "exited"
    if scheduler and scheduler.get("cause") in SCHEDULER:
        return {"why": why, **status, "cause": scheduler["cause"],
                "scheduler": str(scheduler.get("scheduler", ""))[:MAX_SCHEDULER]}
    return {"why": why, "cause": cause, **status}


def with_oom(end: dict[str, Any], oom_kills: int) -> dict[str, Any]:
    """`end` with the OOM kills counted in the job. An OOM kill is the cause where the killer took a process and the
    lead died of SIGKILL or how it ended is not known (the killer sends SIGKILL; a lead that survived a killed child
    and exited is its own end)."""
    if oom_kills <= 0:
        return end
    oom = end.get("signal", 9) == 9 and "exit_code" not in end and end.get("cause") not in SCHEDULER
    return {**end, **({"cause": "oom_kill"} if oom else {}), "oom_kills": oom_kills}
