# SPDX-License-Identifier: Apache-2.0
"""net — the job's TCP and UDP traffic: payload bytes and packets each way, TCP retransmits, connection opens and
closes, and the peers it exchanges the most bytes with.

Hooks (bpf/net.c): on cgroup targets, two BPF_PROG_TYPE_CGROUP_SKB programs linked (BPF_LINK_CREATE) to the job's
cgroup2 directory, which run for exactly the packets of the job's sockets ("packets" source); on PID-tree targets
(no group of its own) the tracepoints sock:sock_send_length / sock_recv_length in the calling thread's context
("syscalls" source: bytes only, TCP peers only). Both: sock:inet_sock_set_state (opens, closes, socket owner and
peer), tcp:tcp_retransmit_skb (owner found by socket address), tcp:tcp_destroy_sock (forgets the socket), and the
membership tracepoints of bpf/common.h. Retransmits, destroys and closes run in softirq and are raw tracepoint
programs on 4.17+: a classic one is skipped whenever it interrupts another classic BPF program on its CPU.
Oldest kernel: 4.16; the packets source needs 5.7 (falls back to syscalls, with an event saying why), syscalls 6.3.
Cost (2-core 6.18 VM, bpf_stats): skb programs ~150-160 ns per skb, only for the job's packets (a 64 KiB GSO skb
is one run: ~25 ns per wire segment in bulk TCP); sock_*_length ~50-150 ns per send/recv call of the node, ~190 ns
for the job's own calls on the syscalls source; inet_sock_set_state ~90-100 ns per TCP state change of the node;
tcp_destroy_sock ~115 ns. A tick reads one per-CPU element and the peer table (<= 2048 entries of 40 bytes, batch
lookups).
What a source cannot see is left out of the sample, never sent as 0: packet counts on the syscalls source; passive
opens and retransmits without sock_*_length (the socket owner cannot be learned); retransmits without
tcp_retransmit_skb.
"""
from __future__ import annotations

import ctypes as ct
import ipaddress
from typing import Any

from jobprobe.contract import tickmemo
from jobprobe.contract.bpfprobe import BpfProbe
from jobprobe.contract.probe import EVENTS_KEY, Field
from jobprobe.contract.target import Target
from jobprobe.core.counters import delta
from jobprobe.core.errors import ProbeUnavailable
from jobprobe.kernel import bpf as _bpf
from jobprobe.kernel import bpfload as _bpfload
from jobprobe.kernel import tracefs
from jobprobe.kernel.host import Host
from jobprobe.kernel.membership import Node

COUNTERS = ("tcp_tx_bytes", "tcp_rx_bytes", "udp_tx_bytes", "udp_rx_bytes",
            "tcp_tx_packets", "tcp_rx_packets", "udp_tx_packets", "udp_rx_packets",
            "tcp_retransmits", "tcp_active_opens", "tcp_passive_opens", "tcp_closes")
RTT = ("tcp_srtt_sum_us", "tcp_srtt_skbs")      # summed in the kernel; tcp_srtt_us is their ratio per interval
PACKET_FIELDS = ("tcp_tx_packets", "tcp_rx_packets", "udp_tx_packets", "udp_rx_packets")
TOP_PEERS = 5
AF_INET, AF_INET6 = 2, 10
STATE = ("sock:inet_sock_set_state", "on_state")
RETRANSMIT = ("tcp:tcp_retransmit_skb", "on_retransmit")
DESTROY = ("tcp:tcp_destroy_sock", "on_destroy")
LENGTHS = (("sock:sock_send_length", "on_send"), ("sock:sock_recv_length", "on_recv"))
STATE_RAW = ("raw:sock:inet_sock_set_state", "on_state_raw")   # closes only; on_state keeps the rest
RAW_HOOKS = {RETRANSMIT: ("raw:tcp:tcp_retransmit_skb", "on_retransmit_raw"),
             DESTROY: ("raw:tcp:tcp_destroy_sock", "on_destroy_raw")}
SKB = (("net_ingress", "cgroup_skb/ingress"), ("net_egress", "cgroup_skb/egress"))


class NetStats(ct.Structure):
    """bpf/net.c struct net_stats, one per job slot and CPU."""
    _fields_ = [(name, ct.c_uint64) for name in COUNTERS + RTT]


class PeerKey(ct.Structure):
    """bpf/net.c struct peer_key."""
    _fields_ = [("slot", ct.c_uint32), ("family", ct.c_uint16), ("port", ct.c_uint16), ("addr", ct.c_uint8 * 16)]


class PeerVal(ct.Structure):
    _fields_ = [("tx_bytes", ct.c_uint64), ("rx_bytes", ct.c_uint64)]


class SockInfo(ct.Structure):
    """bpf/net.c struct sock_info (value of socks, keyed by the kernel's socket address)."""
    _fields_ = [("slot", ct.c_uint32), ("family", ct.c_uint16), ("port", ct.c_uint16), ("addr", ct.c_uint8 * 16)]


def tracepoint_has_field(sys_root: str, category: str, event: str, field: str) -> bool:
    """Whether a tracepoint's format file declares `field` (fields are added across kernel versions)."""
    return field in (tracefs.event_fields(sys_root, category, event) or ())


def peer_addr(family: int, raw: bytes) -> str:
    """Text form of a peer address; an IPv4-mapped IPv6 address (a dual-stack socket) as plain IPv4."""
    if family == AF_INET:
        return str(ipaddress.IPv4Address(bytes(raw[:4])))
    v6 = ipaddress.IPv6Address(bytes(raw[:16]))
    return str(v6.ipv4_mapped or v6)


def top_peers(now: dict, before: dict, n: int = TOP_PEERS) -> list[dict[str, Any]]:
    """The n peers with the most bytes (tx + rx) in the interval, from two cumulative readings
    {(addr, port): (tx, rx)}. A peer evicted from the kernel's LRU table and re-added starts again from 0, which
    delta() reads as a reset."""
    moved = []
    for key, (tx, rx) in now.items():
        btx, brx = before.get(key, (0, 0))
        dtx, drx = delta(tx, btx), delta(rx, brx)
        if dtx or drx:
            moved.append((dtx + drx, key, dtx, drx))
    moved.sort(key=lambda m: (-m[0], m[1]))
    return [{"addr": addr, "port": port, "tx_bytes": dtx, "rx_bytes": drx} for _, (addr, port), dtx, drx in moved[:n]]


def interval(now: dict[str, Any], before: dict[str, Any], emit: tuple[str, ...]) -> dict[str, Any]:
    """This interval's fields from two cumulative readings {"counters": {...}, "peers": {...}}; only `emit`'s
    counters (what this source can see)."""
    out: dict[str, Any] = {k: delta(now["counters"][k], before["counters"][k]) for k in emit}
    if "tcp_tx_packets" in emit and all(k in now["counters"] for k in RTT):
        n = delta(now["counters"]["tcp_srtt_skbs"], before["counters"].get("tcp_srtt_skbs", 0))
        if n:
            out["tcp_srtt_us"] = round(delta(now["counters"]["tcp_srtt_sum_us"],
                                             before["counters"].get("tcp_srtt_sum_us", 0)) / n, 1)
    out["top_peers"] = top_peers(now["peers"], before["peers"])
    return out


def zero_reading() -> dict[str, Any]:
    return {"counters": {k: 0 for k in COUNTERS + RTT}, "peers": {}}


def _by_slot(items: list[tuple[Any, Any]]) -> dict[int, list[tuple[Any, Any]]]:
    out: dict[int, list[tuple[Any, Any]]] = {}
    for key, val in items:
        out.setdefault(key.slot, []).append((key, val))
    return out


class NetProbe(BpfProbe):
    name = "net"
    default = True
    needs_root = True
    summary = "TCP/UDP bytes and packets, retransmits, connection opens/closes and top peers of the job (eBPF)"
    fields = {
        "tcp_tx_bytes": Field("int", "bytes", "TCP payload the job sent (packets source: as it left the IP layer, "
                              "retransmissions included; syscalls source: accepted by send calls)"),
        "tcp_rx_bytes": Field("int", "bytes", "TCP payload the job received (packets source: delivered to its "
                              "sockets; syscalls source: read by recv calls)"),
        "udp_tx_bytes": Field("int", "bytes", "UDP payload the job sent"),
        "udp_rx_bytes": Field("int", "bytes", "UDP payload the job received"),
        "tcp_tx_packets": Field("int", "count", "TCP segments the job sent, after GSO segmentation (packets "
                                "source only)"),
        "tcp_rx_packets": Field("int", "count", "TCP segments the job's sockets received, before GRO merging "
                                "(packets source only)"),
        "udp_tx_packets": Field("int", "count", "UDP datagrams the job sent (packets source only)"),
        "udp_rx_packets": Field("int", "count", "UDP datagrams delivered to the job's sockets (packets source "
                                "only)"),
        "tcp_retransmits": Field("int", "count", "TCP retransmissions (skbs, one or more segments each) on the "
                                 "job's sockets, as the kernel counts them (the socket's TCP_INFO, RetransSegs): one "
                                 "whose transmit failed on the node's own way out (a full qdisc or veth backlog, "
                                 "netfilter) counts; an attempt given up before it (the original still in a host "
                                 "queue, no memory) does not"),
        "tcp_active_opens": Field("int", "count", "TCP connects the job started (SYN sent)"),
        "tcp_passive_opens": Field("int", "count", "TCP connections the job accepted, counted when it first used "
                                   "or closed them"),
        "tcp_closes": Field("int", "count", "TCP connections of the job that reached CLOSE"),
        "tcp_srtt_us": Field("float", "µs", "the smoothed round-trip time of the job's TCP connections, as their "
                             "sockets saw it when sending (the kernel's srtt, averaged over the skbs sent this "
                             "interval; packets source only; absent when nothing was sent): a queue on a slow or "
                             "shaped link shows here before anything is lost", kind="gauge"),
        "top_peers": Field("list[map]", "—", f"up to {TOP_PEERS} peers by payload bytes moved in the interval, "
                           "most first (fields top_peers[].*); syscalls source: TCP peers only"),
        "top_peers[].addr": Field("str", "—", "peer IPv4 or IPv6 address (IPv4-mapped IPv6 shown as IPv4)"),
        "top_peers[].port": Field("int", "—", "the lower of the flow's two ports: the service's in the usual "
                                  "ephemeral-port setup, so a server's clients do not split into one entry each"),
        "top_peers[].tx_bytes": Field("int", "bytes", "payload the job sent to this peer in the interval"),
        "top_peers[].rx_bytes": Field("int", "bytes", "payload the job received from this peer in the interval"),
        "source": Field("str", "—", "where bytes were counted: 'packets' (cgroup skb programs) or 'syscalls' "
                        "(sock_send_length / sock_recv_length tracepoints)"),
    }

    bpf_name = "net"
    # One load for every job of the node: reads its slot's counters and peers; links to a job's group are the job's
    # own.
    map_types = {"stats": (ct.c_uint32, NetStats), "peers": (PeerKey, PeerVal), "socks": (ct.c_uint64, SockInfo)}

    def __init__(self, host: Host | None = None, node: Node | None = None):
        super().__init__(host, node)
        self.source = ""
        self._links: list[int] = []
        self.emit: tuple[str, ...] = ()
        self._pending_events: list[dict[str, Any]] = []

    # ---- what this kernel offers ------------------------------------------------------------------------
    def has_lengths(self) -> bool:
        return all(self.host.tracepoint_exists(*tp.split(":")) for tp, _ in LENGTHS)

    def has(self, hook: tuple[str, str]) -> bool:
        return self.host.tracepoint_exists(*hook[0].split(":"))

    def has_retransmit(self) -> bool:
        return self.has(RETRANSMIT)

    @property
    def handlers(self) -> tuple[tuple[str, str], ...]:   # type: ignore[override]
        """inet_sock_set_state is required (check() says so when missing); the others are used when present. The
        hooks that run in softirq (retransmits, destroys, closes) are raw tracepoint programs where the kernel has
        them (bpf/net.c RAW_SOFTIRQ_HOOKS says why)."""
        optional = (RETRANSMIT, DESTROY, *LENGTHS) if self.has_lengths() else (RETRANSMIT, DESTROY)
        hooks = (STATE, *(h for h in optional if self.has(h)))
        if self.host.has_raw_tracepoints:
            hooks = tuple(RAW_HOOKS.get(h, h) for h in hooks) + (STATE_RAW,)
        return hooks

    def cflags_for(self, source: str) -> list[str]:
        sys_root = self.host.sys
        flags = self.base_cflags()
        if self.has_lengths():
            flags.append("-DHAVE_SOCK_LENGTH")
        if self.has(DESTROY):
            flags.append("-DHAVE_DESTROY")
        if tracepoint_has_field(sys_root, "tcp", "tcp_retransmit_skb", "err"):
            flags.append("-DRETRANS_HAS_ERR")
        if source == "syscalls":
            flags.append("-DCOUNT_SYSCALL_BYTES")
        if self.host.has_raw_tracepoints:
            flags.append("-DRAW_SOFTIRQ_HOOKS")
        return flags

    def fields_for(self, source: str) -> tuple[str, ...]:
        skip = set() if source == "packets" else set(PACKET_FIELDS)
        if not self.has_lengths():
            skip |= {"tcp_passive_opens", "tcp_retransmits"}   # owners of accepted sockets cannot be learned
        if not self.has_retransmit():
            skip.add("tcp_retransmits")
        return tuple(k for k in COUNTERS if k not in skip)

    # ---- the contract -----------------------------------------------------------------------------------
    def preload(self, target: Target | None = None) -> bool:
        """The packets programs (what cgroup targets use) are loaded at the agent's start."""
        self.source = "packets"
        return super().preload(target)

    def load_key(self):
        return (*super().load_key(), self.source)      # the packets and the syscalls programs are two loads

    def start(self, target: Target) -> None:
        """Choose the source: cgroup skb programs linked to the job's group for a cgroup target (one load for every
        job of the node; a link per job), else — or when the links are refused — the send/recv length
        tracepoints."""
        self._pending_events, self._links = [], []
        if target.kind == "cgroup" and target.cgroup_path:
            self.source, self.emit = "packets", self.fields_for("packets")
            try:
                super().start(target)
                self._links = [_bpf.attach_cgroup(self.loaded.progs[fn], target.cgroup_path, hook)
                               for fn, hook in SKB]
                return
            except (ProbeUnavailable, OSError, KeyError) as err:
                self.stop()
                if not self.has_lengths():
                    raise ProbeUnavailable(f"cannot link the cgroup skb programs: {err}") from err
                # An older kernel (no cgroup links) or a refused program: the syscall tracepoints see the same
                # job through its cgroup id, with less detail. Said once, as an event.
                why = str(err) if isinstance(err, ProbeUnavailable) else f"cannot link to {target.cgroup_path}: {err}"
                self._pending_events = [{"event": "net_source_fallback", "source": "syscalls", "why": why}]
        elif not self.has_lengths():
            raise ProbeUnavailable("a PID-tree target needs sock:sock_send_length and sock_recv_length "
                                   "(Linux 6.3+), not found in tracefs")
        self.source, self.emit = "syscalls", self.fields_for("syscalls")
        super().start(target)

    def load(self, target: Target) -> _bpfload.Loaded:
        """The packets programs are loaded unlinked (the cgroup skb functions as programs of their hook's type):
        start() links them to each job's group."""
        cgroups = [(fn, "", hook) for fn, hook in SKB] if self.source == "packets" else []
        return _bpfload.load(self.bpf_name, self.cflags_for(self.source), self.all_handlers(), sys_root=self.host.sys,
                         cgroups=cgroups, pinned=self.pinned())

    def stop(self) -> None:
        """The job's links first (its group stops running the programs), then the rest. Idempotent."""
        links, self._links = getattr(self, "_links", []), []
        _bpf.close_all(links)
        super().stop()

    def sample(self) -> dict[str, Any]:
        out = super().sample()
        if out and self._pending_events:
            out[EVENTS_KEY], self._pending_events = self._pending_events, []
        return out

    def reading(self) -> dict[str, Any]:
        """Cumulative counters of our slot summed over CPUs, and our slot's peers {(addr, port): (tx, rx)}."""
        counters = dict(zip(COUNTERS + RTT, self.slot_sums()))
        peers: dict[tuple[str, int], tuple[int, int]] = {}
        table = self.loaded.maps["peers"]
        by_slot = tickmemo.get(("peers", table), lambda: _by_slot(table.items()))   # once a tick, every job
        for key, val in by_slot.get(self.slot, ()):
            name = (peer_addr(key.family, bytes(key.addr)), key.port)
            tx, rx = peers.get(name, (0, 0))   # a v4-mapped and a plain v4 entry of one peer add up
            peers[name] = (tx + val.tx_bytes, rx + val.rx_bytes)
        return {"counters": counters, "peers": peers}

    def interval(self, now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return {**interval(now, before, self.emit), "source": self.source}
