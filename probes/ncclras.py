# SPDX-License-Identifier: Apache-2.0
"""ncclras — who is behind, by NCCL's own count: NCCL 2.24 and later answers on a RAS port (NCCL_RAS_ADDR,
localhost:28028 by default) with the whole job's view, and (2.26 and later) how many collectives of each kind every
rank has launched (jobprobe/devices/ncclras.py speaks the protocol). A rank that launched fewer than its
communicator's furthest rank is the one the others sit in the collective waiting for; this probe says how many of
this job's ranks on this node are behind, and by how much.

Hooks: a TCP connection to the port (the address from the job's own NCCL_RAS_ADDR, else the default) every 5 s, from
a thread of the probe's own (a status is gathered by a collective over the job's RAS network and can take seconds:
a tick never waits for it). A rank is this node's when its process is one of the job's here and its node address is
one of this host's. Default off: only NCCL jobs have the port, and each poll costs the job one small RAS collective.
No root needed. Where nothing listens, every field but `error` is null.
"""
from __future__ import annotations

import socket
import threading
from typing import Any

from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.devices import ncclras
from jobprobe.kernel import procfs
from jobprobe.kernel.host import Host

EVERY_S = 5.0


def is_local(addr: str, cache: dict[str, bool]) -> bool:
    """Whether `addr` is one of this host's addresses (a socket can be bound to it)."""
    if addr not in cache:
        try:
            fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))
            cache[addr] = True
        except (OSError, ValueError):
            cache[addr] = False
    return cache[addr]


class NcclRasProbe(Probe):
    name = "ncclras"
    default = False
    summary = "NCCL's RAS port (NCCL 2.24+): the job's collective counts per rank — which ranks here are behind"
    fields = {
        "polled": Field("bool", "—", "a status was read since the last tick (the port is asked every 5 s)"),
        "format": Field("str", "—", "`json` (NCCL 2.28.7+: every rank's counts) or `text` (the ranks of the "
                        "groups whose counts differ); null when not read"),
        "comms": Field("int", "count", "communicators in the job's status", kind="gauge"),
        "ranks_here": Field("int", "count", "ranks of the status that are this job's processes on this node (text "
                            "format: only those listed, the ranks of groups whose counts differ)", kind="gauge"),
        "ranks_behind_here": Field("int", "count", "of those, ranks that launched fewer collectives of some kind "
                                   "than their communicator's furthest rank: the ranks the others wait for",
                                   kind="gauge"),
        "ops_behind": Field("int", "count", "the most operations any rank here is behind (0: none is)", kind="gauge"),
        "ranks_behind": Field("int", "count", "ranks behind in the whole job", kind="gauge"),
        "missing_ranks": Field("int", "count", "ranks the status has no data from (a process gone or unreachable)",
                               kind="gauge"),
        "error": Field("str", "—", "why the last poll failed (nothing listens: not an NCCL 2.24+ job), else null"),
    }

    def __init__(self, host: Host | None = None, every: float = EVERY_S):
        super().__init__(host)
        self.every = every
        self.target: Target | None = None
        self.addr: tuple[str, int] | None = None
        self.stop_ev = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.latest: ncclras.Status | None = None
        self.fresh = False
        self.error: str | None = None
        self.local: dict[str, bool] = {}

    def start(self, target: Target) -> None:
        self.target = target
        self.stop_ev.clear()
        self.thread = threading.Thread(target=self._run, name="jobprobe-ncclras", daemon=True)
        self.thread.start()

    def _address(self) -> tuple[str, int]:
        """The job's NCCL_RAS_ADDR (host:port; [v6]:port), else localhost:28028."""
        for pid in self.target.pids()[:8] if self.target else ():
            v = (procfs.environ(self.host.proc, pid, ("NCCL_RAS_ADDR",)) or {}).get("NCCL_RAS_ADDR")
            if v:
                h, _, p = v.rpartition(":")
                if p.isdigit() and h:
                    return h.strip("[]"), int(p)
        return "127.0.0.1", ncclras.PORT

    def _run(self) -> None:
        while not self.stop_ev.is_set():
            try:
                st, err = ncclras.poll(self._address(), timeout=max(2.0, self.every)), None
            except (OSError, ValueError) as e:
                st, err = None, f"{type(e).__name__}: {e}"[:200]
            with self.lock:
                self.latest, self.fresh, self.error = st or self.latest, st is not None or self.fresh, err
            self.stop_ev.wait(self.every)

    def sample(self) -> dict[str, Any]:
        with self.lock:
            st, fresh, err = self.latest, self.fresh, self.error
            self.fresh = False
        out: dict[str, Any] = {k: None for k in self.fields}
        out.update(polled=fresh, error=err)
        if st is None:
            return out
        pids = set(self.target.pids()) if self.target else set()
        here = behind_here = most = behind = 0
        for c in st.comms:
            lag = c.behind()
            behind += len(lag)
            for r in c.ranks:
                if r.pid in pids and is_local(r.host, self.local):
                    here += 1
                    if r.rank in lag:
                        behind_here += 1
                        most = max(most, lag[r.rank])
        out.update(format="json" if st.json else "text", comms=len(st.comms), ranks_here=here,
                   ranks_behind_here=behind_here, ops_behind=most, ranks_behind=behind,
                   missing_ranks=sum(c.missing for c in st.comms))
        return out

    def stop(self) -> None:
        self.stop_ev.set()
        if self.thread is not None:
            self.thread.join(timeout=15)
            self.thread = None
        self.target = None
