# SPDX-License-Identifier: Apache-2.0
"""nic — the network interfaces the job uses: traffic, errors, drops and the queue in front of each, per interval.

Which interfaces: those of the job's network namespace (its first process's /proc/PID/ns/net: the host's, or a
container's or a test's own), up and not loopback — or, when the job's environment names them
(`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`: prefixes, `^` to exclude, `=` for an exact name), those. In the host's
namespace the interfaces are shared by every job on the node: `shared` says so, and the figures are the
interface's, not the job's (the `net` probe counts the job's own bytes).

Hooks: rtnetlink in the job's namespace — RTM_GETLINK (the counters of `ip -s link` and /proc/net/dev) and
RTM_GETQDISC (the root queueing discipline's statistics, as `tc -s qdisc`: a queue that drops or holds packets
back is a link slower than what is sent to it). A socket per namespace, made by a thread that joins it (setns)
and shared by every job in it; one reading per namespace per tick. Link speed from /sys/class/net/<if>/speed in
the agent's own namespace (absent for another namespace's interfaces). Kernel: any. Root: for another namespace
(setns) and to read another user's environment.

Rails: with two or more interfaces chosen, each interval compares their traffic (bytes sent + received): when the
median of them carries at least RAIL_BUSY_BPS, a rail under RAIL_SLOW (half) of that median is slow
(`rails_slow`, `nics[].rail_share`) — one NIC of four at 20% of its peers holds a whole collective back. The
`rail_imbalance` rule (jobprobe/node/default_rules.toml) fires when it lasts.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from jobprobe.contract import tickmemo
from jobprobe.contract.probe import Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.kernel import ethtool, procfs, rtnl
from jobprobe.kernel.host import Host

RECHECK_S = 10.0           # the job's namespace and environment looked at again
ENV_KEYS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
LINK_COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors", "rx_dropped",
                 "tx_dropped")
QDISC_COUNTERS = ("drops", "overlimits", "requeues")

RAIL_BUSY_BPS = 1 << 20    # the median rail must carry this much (bytes/s, sent + received) to compare them
RAIL_SLOW = 0.5            # a rail under this share of the median is slow

_sockets: dict[int, Any] = {}      # netns inode → its rtnetlink socket (shared by the jobs in it)
_pause: dict[int, ethtool.PauseReader] = {}   # netns inode → its ethtool reader (an AF_INET socket made in it)
# netns inode → the probes reading it. A socket made in a namespace holds the namespace (and its interfaces) alive:
# when the last probe of a namespace lets go, its sockets are closed, or a long-lived agent would keep every pod's
# namespace and veths it ever saw.
_users: dict[int, set[int]] = {}
_users_lock = threading.Lock()


def _use(ino: int | None, who: int) -> None:
    if ino is not None:
        with _users_lock:
            _users.setdefault(ino, set()).add(who)


def _release(ino: int | None, who: int) -> None:
    """`who` no longer reads namespace `ino`: the last one out closes its sockets."""
    if ino is None:
        return
    with _users_lock:
        users = _users.get(ino)
        if users is None:
            return
        users.discard(who)
        if users:
            return
        del _users[ino]
        sock, pause = _sockets.pop(ino, None), _pause.pop(ino, None)
    for s in (sock, pause.sock if pause is not None else None):
        if s is not None:
            try:
                s.close()
            except OSError:
                pass


def fields() -> dict[str, Field]:
    out = {
        "nics": Field("list[map]", "—", "the job's interfaces (fields nics[].*)"),
        "netns": Field("str", "—", "'host' (the agent's own namespace) or 'netns:<inode>' (the job's own)"),
        "shared": Field("bool", "—", "the interfaces are the host's, shared by every job on the node: figures are "
                        "the interface's, not the job's"),
        "selected_by": Field("str", "—", "how the interfaces were chosen: 'all' (up, not loopback) or the job's "
                             "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME"),
        "rails": Field("int", "count", "interfaces compared as rails this interval (2 or more chosen and the median "
                       f"of them busy, ≥ {RAIL_BUSY_BPS >> 20} MiB/s sent + received; else 0)", kind="gauge"),
        "rails_slow": Field("int", "count", f"rails carrying under {RAIL_SLOW:.0%} of the median rail's bytes this "
                            "interval (0 when rails is 0)", kind="gauge"),
        "nics[].rail_share": Field("float", "ratio", "this interface's bytes (sent + received) over the median "
                                   "rail's, this interval (absent when rails is 0)", kind="gauge"),
        "nics[].name": Field("str", "—", "interface name"),
        "nics[].up": Field("bool", "—", "operationally up"),
        "nics[].speed_mbps": Field("int", "Mbit/s", "link speed (agent's namespace only; absent when unknown)",
                                   kind="gauge"),
        "nics[].tx_util_pct": Field("float", "%", "transmit rate over link speed this interval", kind="gauge"),
        "nics[].rx_util_pct": Field("float", "%", "receive rate over link speed this interval", kind="gauge"),
        "nics[].pause_rx_frames": Field("int", "count", "pause and PFC frames received this interval: the sum of "
                                        "the driver's pause / pfc / xon / xoff counters (ethtool -S); absent when "
                                        "the driver counts none"),
        "nics[].pause_tx_frames": Field("int", "count", "pause and PFC frames sent this interval (as pause_rx_frames)"),
        "nics[].qdisc": Field("str", "—", "the root queueing discipline (fq_codel, mq, tbf, noqueue, …)"),
        "nics[].qdisc_backlog_bytes": Field("int", "bytes", "bytes waiting in the queue now", kind="gauge"),
        "nics[].qdisc_qlen": Field("int", "count", "packets waiting in the queue now", kind="gauge"),
    }
    for k in LINK_COUNTERS:
        what = k.replace("_", " ").replace("rx", "received").replace("tx", "sent")
        out[f"nics[].{k}"] = Field("int", "bytes" if k.endswith("bytes") else "count",
                                   f"{what} by the interface this interval (rtnl_link_stats64)")
    out["nics[].qdisc_drops"] = Field("int", "count", "packets the queue dropped this interval")
    out["nics[].qdisc_overlimits"] = Field("int", "count", "times the queue held packets back, over its rate or "
                                           "limit, this interval (a shaper's or a slow link's signature)")
    out["nics[].qdisc_requeues"] = Field("int", "count", "packets the driver handed back (device busy)")
    return out


def wanted(names: list[str], spec: str | None) -> list[str]:
    """NCCL's interface selection: comma-separated prefixes; `^` excludes them; `=` makes them exact names."""
    if not spec:
        return names
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [s for s in spec.lstrip("=").split(",") if s]

    def match(n: str) -> bool:
        return any(n == s if exact else n.startswith(s) for s in items)
    return [n for n in names if match(n) != exclude]


def compare_rails(nics: list[dict], dt: float) -> tuple[int, int]:
    """Each interface's bytes against the median of them (loopback left out): (rails compared, rails slow); sets
    nics[].rail_share when compared."""
    rails = [n for n in nics if n["name"] != "lo"]
    if len(rails) < 2:
        return 0, 0
    load = sorted(n["tx_bytes"] + n["rx_bytes"] for n in rails)
    mid = len(load) // 2
    median = load[mid] if len(load) % 2 else (load[mid - 1] + load[mid]) / 2
    if median / dt < RAIL_BUSY_BPS:
        return 0, 0
    slow = 0
    for n in rails:
        n["rail_share"] = round((n["tx_bytes"] + n["rx_bytes"]) / median, 3)
        slow += n["rail_share"] < RAIL_SLOW
    return len(rails), slow


def netns_inode(proc: str, pid: int | str) -> int | None:
    try:
        return os.stat(f"{proc}/{pid}/ns/net").st_ino
    except OSError:
        return None


def reading(proc: str, pid: int, ino: int, own: int | None) -> dict[str, tuple]:
    """{name: (link, qdisc or None)} of the namespace `ino` — once per tick per namespace, whatever the jobs."""
    def read() -> dict[str, tuple]:
        sock = _sockets.get(ino)
        if sock is None:
            sock = rtnl.socket_in(None if ino == own else f"{proc}/{pid}/ns/net")
            _sockets[ino] = sock
        try:
            links, qd = rtnl.links(sock), rtnl.root_qdiscs(sock)
        except OSError:
            _sockets.pop(ino, None)
            sock.close()
            old = _pause.pop(ino, None)
            if old is not None:
                old.sock.close()
            raise
        pause = _pause.get(ino)
        if pause is None:
            pause = _pause[ino] = ethtool.PauseReader(rtnl.socket_in(None if ino == own else f"{proc}/{pid}/ns/net",
                                                                     socket.AF_INET, socket.SOCK_DGRAM, 0))
        return {ln.name: (ln, qd.get(i), pause.read(ln.name)) for i, ln in links.items()}
    return tickmemo.get(("nic", ino), read)


class NicProbe(Probe):
    name = "nic"
    default = True
    summary = "the job's network interfaces: traffic, errors, drops, link use and the queue in front (rtnetlink)"
    fields = fields()

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.target: Target | None = None
        self.pid: int | None = None
        self.ino: int | None = None
        self.own = netns_inode(self.host.proc, "self")
        self.spec: str | None = None
        self.by = "all"
        self.prev: dict[str, dict[str, int]] = {}
        self.prev_seen: dict | None = None     # the dump `prev` came from (shared by the jobs of one tick)
        self.checked = -1e9
        self.files = procfs.OpenFiles()
        self.t_prev = 0.0

    def start(self, target: Target) -> None:
        """A job attached before its processes (a prolog, `run -- CMD`) has no namespace yet: the probe waits
        (status "ok: waiting for …") and starts counting at the first tick that finds one of its processes."""
        self.target = target
        self.checked = -1e9
        self.ino = None
        self._recheck()
        if self.ino is not None:
            self._first()

    def _first(self) -> None:
        """The namespace's counters now: the base of the first interval."""
        try:
            self.prev = self._counters(reading(self.host.proc, self.pid, self.ino, self.own))
            self.prev_seen = None
        except OSError as err:
            _release(self.ino, id(self))      # a start that fails lets go of what it took
            self.ino = None
            raise ProbeUnavailable(f"rtnetlink in the job's network namespace: {err}") from err
        self.t_prev = time.monotonic()

    def note(self) -> str | None:
        return "waiting for the job's first process (its network namespace)" if self.ino is None else None

    def _recheck(self) -> None:
        now = time.monotonic()
        if now - self.checked < RECHECK_S and self.ino is not None:
            return
        self.checked = now
        pids = self.target.pids()
        if not pids:
            if self.ino is None:
                return
            raise TargetGone("the job has no processes")
        self.pid = pids[0]
        ino = netns_inode(self.host.proc, self.pid)
        if ino is not None and ino != self.ino:
            _use(ino, id(self))
            _release(self.ino, id(self))      # the job moved to another namespace: the old one may go
            self.ino = ino
        env = procfs.environ(self.host.proc, self.pid, ENV_KEYS)
        if env is None:            # not readable yet (a process inside exec): ask again next tick
            self.checked = -1e9
            return
        key = next((k for k in ENV_KEYS if env.get(k)), None)
        self.spec = env[key] if key else None
        self.by = f"{key}={self.spec}" if key else "all"

    def _chosen(self, seen: dict[str, tuple]) -> list[str]:
        if self.spec:
            return wanted(sorted(seen), self.spec)
        return sorted(n for n, (ln, _, _) in seen.items() if ln.up and n != "lo")

    def _counters(self, seen: dict[str, tuple]) -> dict[str, dict[str, int]]:
        out = {}
        for n in self._chosen(seen):
            ln, qd, pause = seen[n]
            c = {k: ln.stats.get(k, 0) for k in LINK_COUNTERS}
            if qd is not None:
                c.update({f"qdisc_{k}": getattr(qd, k) for k in QDISC_COUNTERS})
            if pause is not None:
                c["pause_rx_frames"], c["pause_tx_frames"] = pause
            out[n] = c
        return out

    def sample(self) -> dict:
        if self.target is None:
            return {}
        if self.ino is None:              # attached before its processes: none yet, or the first one now
            self._recheck()
            if self.ino is not None:
                self._first()
            return {}
        self._recheck()
        # every job in the same network namespace sees the same links: one rtnetlink dump per namespace and tick
        seen = tickmemo.get(("nic", self.ino), lambda: reading(self.host.proc, self.pid, self.ino, self.own))
        now_t = time.monotonic()
        dt, self.t_prev = max(now_t - self.t_prev, 1e-6), now_t
        # jobs of one namespace choosing the same interfaces, whose last reading was the same dump, have the same
        # interval: worked out once per tick
        key = ("nic-items", self.ino, self.spec, id(self.prev_seen)) if self.prev_seen is not None else None
        nics, cur, (rails, slow) = tickmemo.get(key, lambda: self._items(seen, dt)) if key else self._items(seen, dt)
        self.prev, self.prev_seen = cur, seen
        self.files.sweep()
        return {"nics": nics, "netns": "host" if self.ino == self.own else f"netns:{self.ino}",
                "shared": self.ino == self.own, "selected_by": self.by, "rails": rails, "rails_slow": slow}

    def _items(self, seen: dict[str, tuple], dt: float) -> tuple[list[dict], dict[str, dict[str, int]], tuple]:
        cur = self._counters(seen)
        nics = []
        for n, c in cur.items():
            ln, qd, _ = seen[n]
            before = self.prev.get(n)
            item: dict[str, Any] = {"name": n, "up": ln.up}
            item.update({k: delta(v, before[k]) if before and k in before else 0 for k, v in c.items()})
            if qd is not None:
                item.update(qdisc=qd.kind, qdisc_backlog_bytes=qd.backlog, qdisc_qlen=qd.qlen)
            if self.ino == self.own:
                path = f"{self.host.sys}/class/net/{n}/speed"
                speed = tickmemo.get(("speed", path), lambda: self.files.read(path))   # once per tick for every job
                try:
                    mbps = int((speed or "").split()[0])
                except (ValueError, IndexError):
                    mbps = -1
                if mbps > 0:
                    item["speed_mbps"] = mbps
                    item["tx_util_pct"] = round(item["tx_bytes"] * 8 / dt / (mbps * 1e6) * 100, 2)
                    item["rx_util_pct"] = round(item["rx_bytes"] * 8 / dt / (mbps * 1e6) * 100, 2)
            nics.append(item)
        return nics, cur, compare_rails(nics, dt)

    def stop(self) -> None:
        self.target = None
        self.files.close()
        _release(self.ino, id(self))
        self.ino = None
