# SPDX-License-Identifier: Apache-2.0
"""rdma — the job's InfiniBand / RoCE ports: traffic, link health and congestion, per interval, with a verdict.

Which ports: every port of every device in /sys/class/infiniband, or — when the job's environment names them
(`NCCL_IB_HCA`: `mlx5_0:1,mlx5_1` prefixes of device names with an optional port, `^` to exclude, `=` for exact
names) — those. A port is shared by every job that uses it: the port's figures are the port's (`shared` is always
true). The job's own share, where the kernel can say it: the queue-pair counters of its processes through RDMA
netlink (jobprobe/kernel/rdmanl.py) — the probe turns a port whose QP counter mode is unset to auto mode with the PID
mask (`rdma statistic qp set link DEV/PORT auto pid on`: a counter per process for the QPs it makes from then on;
a mode an operator set is left as it is), and reports per port, in `job`, the counters of the job's processes and
threads summed (`qp_counters` says whether, or why not). The mode stays on after the agent ends; it binds only QPs
made after it was set.

Per port: bytes and packets (IB port_xmit_data / port_rcv_data count 4-byte words per lane: ×4), link use over
the port's rate, the IB error counters (symbol_error, link_downed, link_error_recovery, port_rcv_errors,
port_xmit_discards, excessive_buffer_overrun_errors, local_link_integrity_errors …), port_xmit_wait (ticks the port
had data to send and no credit: congestion), and the driver's hw_counters (mlx5 names; irdma's mapped to them):
ECN-marked packets and CNPs (RoCE congestion control), out-of-sequence and sequence errors, ack timeouts, RNR
retries, adaptive-retransmission and slow-restart events, receive-buffer exhaustion.

Health, per port (NVIDIA NVSentinel's thresholds: the IBTA bit-error-rate bound of 10⁻¹² is ~120 symbol errors an
hour at HDR): `fatal` — the link went down (link_downed rose, or the port left ACTIVE) or more than 120 symbol
errors in the last hour; `degraded` — symbol errors, link error recoveries or RoCE slow restarts in the last hour;
else `ok`. A change of verdict is an `rdma_health` event with its reasons; `ports_fatal` / `ports_degraded` feed
the rules (rdma_port_fatal, rdma_port_degraded in jobprobe/node/default_rules.toml).

Hooks: sysfs (jobprobe/devices/rdma.py); RDMA netlink for the job's QP counters (5.3+, a driver with counter binding:
mlx5). Kernel: any with the IB core. Root: to read another user's environment and to set a port's counter mode.
A RoCE port's pause / PFC frames come from its Ethernet driver's statistics (SIOCETHTOOL, jobprobe/kernel/ethtool.py).
Cost: ~40-60 small file reads per port per tick, two ioctls per RoCE port. Limits: counters a driver does not keep
are absent.
"""
from __future__ import annotations

import collections
import os
import socket
import time
from typing import Any

from jobprobe.contract import tickmemo
from jobprobe.contract.probe import EVENTS_KEY, Field, Probe
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta
from jobprobe.core.errors import ProbeUnavailable, TargetGone
from jobprobe.devices import rdma
from jobprobe.kernel import ethtool, procfs, rdmanl
from jobprobe.kernel.host import Host

RECHECK_S = 10.0
SYMBOL_FATAL_PER_H = 120
HEALTH_WINDOW_S = 3600.0
ENV_KEY = "NCCL_IB_HCA"

# IB port counters read, by field name (data and packets handled apart: words ×4)
IB_ERRORS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "port_rcv_remote_physical_errors",
             "port_rcv_switch_relay_errors", "port_xmit_discards", "port_xmit_constraint_errors",
             "port_rcv_constraint_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
             "VL15_dropped", "port_xmit_wait")
HW = ("np_cnp_sent", "rp_cnp_handled", "rp_cnp_ignored", "np_ecn_marked_roce_packets", "out_of_sequence",
      "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err", "implied_nak_seq_err", "duplicate_request",
      "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart", "roce_slow_restart_cnps", "out_of_buffer",
      "req_cqe_error", "resp_cqe_error")
# irdma (Intel E810) hw_counters under mlx5's names
IRDMA_NAMES = {"cnpSent": "np_cnp_sent", "cnpHandled": "rp_cnp_handled", "cnpIgnored": "rp_cnp_ignored",
               "RxECNMrkd": "np_ecn_marked_roce_packets"}
DEGRADING = ("symbol_error", "link_error_recovery", "roce_slow_restart")
PAUSE = ("pause_rx_frames", "pause_tx_frames")


def selected(ports: list[rdma.Port], spec: str | None) -> list[rdma.Port]:
    """NCCL_IB_HCA: comma-separated device-name prefixes, each with an optional :port; `^` excludes; `=` exact."""
    if not spec:
        return ports
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = []
    for s in spec.lstrip("=").split(","):
        dev, _, port = s.strip().partition(":")
        if dev:
            items.append((dev, int(port) if port.isdigit() else None))

    def match(p: rdma.Port) -> bool:
        return any((p.device == d if exact else p.device.startswith(d)) and (n is None or n == p.port)
                   for d, n in items)
    return [p for p in ports if match(p) != exclude]


def _why(err: OSError) -> str:
    return os.strerror(err.errno) if err.errno else str(err)


def fields() -> dict[str, Field]:
    out = {
        "ports": Field("list[map]", "—", "the job's RDMA ports (fields ports[].*)"),
        "shared": Field("bool", "—", "always true: a port's figures are the port's, shared by every job using it"),
        "selected_by": Field("str", "—", "'all', or the job's NCCL_IB_HCA"),
        "ports_fatal": Field("int", "count", "ports whose health is fatal now", kind="gauge"),
        "ports_degraded": Field("int", "count", "ports whose health is degraded now", kind="gauge"),
        "qp_counters": Field("str", "—", "'per process on <ports>': the job's own QP counters are read there "
                             "(ports[].job); and for each other port why not (no RDMA netlink, a driver without "
                             "counter binding, a mode set otherwise)"),
        "ports[].job": Field("map", "count", "the job's own QP counters this interval, by the driver's name "
                             "(out_of_sequence, local_ack_timeout_err, rnr_nak_retry_err, rx_write_requests, …; "
                             "rdma_tx_bytes and kin where the driver's optional counters are on): the counters of "
                             "the job's processes and threads, summed"),
        "ports[].job_qps": Field("int", "count", "the job's QPs bound to its counters now (QPs made before the "
                                 "port's mode was set are not)", kind="gauge"),
        "ports[].name": Field("str", "—", "device/port, as mlx5_0/1"),
        "ports[].state": Field("str", "—", "the port's logical state: ACTIVE, DOWN, INIT, ARMED"),
        "ports[].phys_state": Field("str", "—", "the physical link: LinkUp, Polling, Disabled, …"),
        "ports[].link_layer": Field("str", "—", "InfiniBand or Ethernet (RoCE)"),
        "ports[].netdev": Field("str", "—", "a RoCE port's Ethernet interface (absent for InfiniBand)"),
        "ports[].rate_gbps": Field("float", "Gbit/s", "the link's rate (all lanes)", kind="gauge"),
        "ports[].tx_bytes": Field("int", "bytes", "bytes sent by the port this interval (port_xmit_data × 4)"),
        "ports[].rx_bytes": Field("int", "bytes", "bytes received by the port this interval (port_rcv_data × 4)"),
        "ports[].tx_packets": Field("int", "count", "packets sent this interval (port_xmit_packets)"),
        "ports[].rx_packets": Field("int", "count", "packets received this interval (port_rcv_packets)"),
        "ports[].tx_util_pct": Field("float", "%", "sent rate over the link's rate", kind="gauge"),
        "ports[].rx_util_pct": Field("float", "%", "received rate over the link's rate", kind="gauge"),
        "ports[].health": Field("str", "—", "ok | degraded | fatal (see the probe's docs for the thresholds)"),
        "ports[].health_why": Field("str", "—", "why the port is not ok (absent when ok)"),
        "ports[].symbol_errors_1h": Field("int", "count", "symbol errors over the last hour (or since attach)",
                                          kind="gauge"),
    }
    what = {"port_xmit_wait": "ticks the port had data to send but no flow-control credit (congestion)"}
    for k in IB_ERRORS:
        out[f"ports[].{k}"] = Field("int", "count", what.get(k, f"IB port counter {k} this interval"))
    for k in HW:
        out[f"ports[].{k}"] = Field("int", "count", f"driver hw_counter {k} this interval (absent when the "
                                    "driver does not keep it)")
    for k, way in (("pause_rx_frames", "received"), ("pause_tx_frames", "sent")):
        out[f"ports[].{k}"] = Field("int", "count", f"a RoCE port: pause and PFC frames its Ethernet interface {way} "
                                    "this interval (the driver's pause / pfc / xon / xoff counters, ethtool -S)")
    return out


class RdmaProbe(Probe):
    name = "rdma"
    default = True
    summary = "the job's InfiniBand/RoCE ports: traffic, link errors, congestion and a health verdict (sysfs)"
    fields = fields()

    def __init__(self, host: Host | None = None):
        super().__init__(host)
        self.target: Target | None = None
        self.spec: str | None = None
        self.checked = -1e9
        self.prev: dict[str, dict[str, int]] = {}
        self.t_prev = 0.0
        self.symbols: dict[str, collections.deque] = {}    # port → (t, cumulative symbol_error)
        self.recent: dict[str, collections.deque] = {}     # port → (t, degrading counters' sum) for an hour
        self.health: dict[str, str] = {}
        self.was_active: dict[str, bool] = {}
        self.pause: ethtool.PauseReader | None = None
        self.nl: rdmanl.RdmaNetlink | None = None
        self.qp_ports: dict[str, tuple[int, int]] = {}       # port name → (device index, port) read per process
        self.qp_why = "not read"
        self.qp_prev: dict[tuple, dict[str, int]] = {}       # (device, counter id, pid) → values at the last tick
        self.tgids: dict[int, int | None] = {}               # a counter's thread id → its process

    def open_netlink(self) -> rdmanl.RdmaNetlink:
        return rdmanl.RdmaNetlink()

    def check(self, host: Host) -> str | None:
        why = super().check(host)
        if why:
            return why
        if not rdma.devices(host.sys):
            return f"no RDMA device ({host.sys}/{rdma.CLASS} is empty or absent)"
        return None

    def start(self, target: Target) -> None:
        self.target = target
        self._recheck()
        now = time.monotonic()
        self.prev = {p.name: self._read(p) for p in self._ports()}
        if not self.prev:
            raise ProbeUnavailable(f"no RDMA port matches the job's {ENV_KEY}={self.spec}")
        self._qp_setup(self._ports())
        if self.qp_ports:
            self.qp_prev = {k: v for k, (v, _) in self._job_counters(self.target.pids()).items()}
        self.t_prev = now

    # ---- the job's own QP counters (RDMA netlink) ---------------------------------------------------------
    def _qp_setup(self, ports: list[rdma.Port]) -> None:
        try:
            self.nl = self.open_netlink()
            index = self.nl.devices()
        except OSError as err:
            self.qp_why = f"no RDMA netlink: {_why(err)}"
            return
        why = []
        for p in ports:
            if p.device not in index:
                why.append(f"{p.name}: not in RDMA netlink")
                continue
            try:
                mode, mask = self.nl.qp_mode(index[p.device], p.port)
                if mode == rdmanl.MODE_NONE or (mode == rdmanl.MODE_AUTO and mask == 0):
                    self.nl.set_auto_pid(index[p.device], p.port)
                    mode, mask = self.nl.qp_mode(index[p.device], p.port)
            except OSError as err:
                why.append(f"{p.name}: {_why(err)}")
                continue
            if mode == rdmanl.MODE_AUTO and mask & rdmanl.MASK_PID:
                self.qp_ports[p.name] = (index[p.device], p.port)
            else:
                how = "manual" if mode == rdmanl.MODE_MANUAL else f"auto without the PID mask (mask {mask})"
                why.append(f"{p.name}: counter mode {how}, set by someone else: left as it is")
        self.qp_why = "; ".join(([f"per process on {', '.join(self.qp_ports)}"] if self.qp_ports else []) + why) \
            or "no port"

    def _job_counters(self, pids: list[int]) -> dict[tuple, tuple[dict[str, int], int]]:
        """The QP counters of the job's processes (and their threads) on its ports: key → (values, QPs bound)."""
        members = set(pids)
        out = {}
        for name, (index, port) in self.qp_ports.items():
            # every job of the node reads the same table: once per tick
            counters = tickmemo.get(("rdma_qp", index), lambda: self.nl.qp_counters(index))
            for c in counters:
                if c.port != port or c.pid is None:
                    continue
                if c.pid not in self.tgids:
                    self.tgids[c.pid] = procfs.tgid(self.host.proc, c.pid)
                if c.pid in members or self.tgids[c.pid] in members:
                    out[(name, c.id, c.pid)] = (c.values, len(c.qps))
        return out

    def _job_deltas(self) -> dict[str, tuple[dict[str, int], int]]:
        """Per port: the job's counters this interval (a counter new since the last tick counts whole) and QPs."""
        try:
            now = self._job_counters(self.target.pids())
        except OSError as err:
            self.qp_why = f"RDMA netlink: {_why(err)}"
            return {}
        out: dict[str, tuple[dict[str, int], int]] = {name: ({}, 0) for name in self.qp_ports}
        for key, (values, qps) in now.items():
            before = self.qp_prev.get(key, {})
            d, n = out[key[0]]
            for k, v in values.items():
                d[k] = d.get(k, 0) + delta(v, before.get(k, 0))
            out[key[0]] = (d, n + qps)
        self.qp_prev = {k: v for k, (v, _) in now.items()}
        alive = {k[2] for k in now}
        self.tgids = {t: g for t, g in self.tgids.items() if t in alive}
        return out

    def _recheck(self) -> None:
        now = time.monotonic()
        if now - self.checked < RECHECK_S:
            return
        self.checked = now
        pids = self.target.pids()
        if not pids:
            if self.spec is None and not self.prev:
                return
            raise TargetGone("the job has no processes")
        env = procfs.environ(self.host.proc, pids[0], (ENV_KEY,))
        if env is None:            # not readable yet (a process inside exec): ask again next tick
            self.checked = -1e9
            return
        self.spec = env.get(ENV_KEY) or None

    def _ports(self) -> list[rdma.Port]:
        return selected(rdma.ports(self.host.sys), self.spec)

    def _read(self, p: rdma.Port) -> dict[str, int]:
        ib, hw = rdma.counters(self.host.sys, p.device, p.port)
        c = {k: v for k, v in ib.items() if k in IB_ERRORS}
        for k in ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"):
            if k in ib:
                c[k] = ib[k]
        for k, v in hw.items():
            k = IRDMA_NAMES.get(k, k)
            if k in HW:
                c[k] = v
        if p.netdev:                       # a RoCE port: its Ethernet driver's pause / PFC frames (ethtool -S)
            if self.pause is None:
                self.pause = ethtool.PauseReader(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            got = self.pause.read(p.netdev)
            if got is not None:
                c["pause_rx_frames"], c["pause_tx_frames"] = got
        return c

    def sample(self) -> dict[str, Any]:
        if self.target is None:
            return {}
        self._recheck()
        now, wall = time.monotonic(), time.time()
        dt, self.t_prev = max(now - self.t_prev, 1e-6), now
        out_ports, events, cur = [], [], {}
        fatal = degraded = 0
        mine = self._job_deltas() if self.qp_ports else {}
        for p in self._ports():
            c = cur[p.name] = self._read(p)
            before = self.prev.get(p.name, c)
            d = {k: delta(v, before[k]) if k in before else 0 for k, v in c.items()}
            item: dict[str, Any] = {"name": p.name, "state": p.state, "phys_state": p.phys_state,
                                    "link_layer": p.link_layer}
            if p.netdev:
                item["netdev"] = p.netdev
            if p.rate_gbps:
                item["rate_gbps"] = p.rate_gbps
            item["tx_bytes"] = d.get("port_xmit_data", 0) * 4
            item["rx_bytes"] = d.get("port_rcv_data", 0) * 4
            item["tx_packets"] = d.get("port_xmit_packets", 0)
            item["rx_packets"] = d.get("port_rcv_packets", 0)
            if p.rate_gbps:
                item["tx_util_pct"] = round(item["tx_bytes"] * 8 / dt / (p.rate_gbps * 1e9) * 100, 3)
                item["rx_util_pct"] = round(item["rx_bytes"] * 8 / dt / (p.rate_gbps * 1e9) * 100, 3)
            item.update({k: d[k] for k in IB_ERRORS + HW + PAUSE if k in d})
            if p.name in mine:
                item["job"], item["job_qps"] = mine[p.name]
            verdict, why, sym_1h = self._health(p, c, d, now)
            item["health"], item["symbol_errors_1h"] = verdict, sym_1h
            if why:
                item["health_why"] = why
            fatal += verdict == "fatal"
            degraded += verdict == "degraded"
            if self.health.get(p.name, "ok") != verdict:
                events.append({"event": "rdma_health", "port": p.name, "health": verdict,
                               "was": self.health.get(p.name, "ok"), "why": why or "recovered", "t": wall})
            self.health[p.name] = verdict
            out_ports.append(item)
        self.prev = cur
        out: dict[str, Any] = {"ports": out_ports, "shared": True, "selected_by": f"{ENV_KEY}={self.spec}"
                               if self.spec else "all", "ports_fatal": fatal, "ports_degraded": degraded,
                               "qp_counters": self.qp_why}
        if events:
            out[EVENTS_KEY] = events
        return out

    def _health(self, p: rdma.Port, c: dict[str, int], d: dict[str, int], now: float) -> tuple[str, str, int]:
        """The port's verdict, why, and its symbol errors over the last hour."""
        sym = self.symbols.setdefault(p.name, collections.deque())
        sym.append((now, c.get("symbol_error", 0)))
        deg = self.recent.setdefault(p.name, collections.deque())
        deg.append((now, sum(d.get(k, 0) for k in DEGRADING)))
        while sym and now - sym[0][0] > HEALTH_WINDOW_S:
            sym.popleft()
        while deg and now - deg[0][0] > HEALTH_WINDOW_S:
            deg.popleft()
        sym_1h = max(0, sym[-1][1] - sym[0][1])
        fatal = []
        if d.get("link_downed", 0) > 0:
            fatal.append(f"link went down {d['link_downed']}×")
        active = p.state == "ACTIVE"
        if self.was_active.get(p.name) and not active:
            fatal.append(f"port left ACTIVE ({p.state or '?'}, {p.phys_state or '?'})")
        if active:
            self.was_active[p.name] = True
        if sym_1h > SYMBOL_FATAL_PER_H:
            fatal.append(f"{sym_1h} symbol errors in the last hour (> {SYMBOL_FATAL_PER_H})")
        if fatal:
            return "fatal", "; ".join(fatal), sym_1h
        recent = sum(x for _, x in deg)
        if recent:
            what = [k for k in DEGRADING if d.get(k)] or ["symbol errors, link error recoveries or slow restarts"]
            return "degraded", f"{recent} of {', '.join(what)} in the last hour", sym_1h
        return "ok", "", sym_1h

    def stop(self) -> None:
        self.target = None
        if self.pause is not None:
            self.pause.sock.close()
            self.pause = None
        if self.nl is not None:
            self.nl.close()
            self.nl = None
        self.qp_ports = {}

