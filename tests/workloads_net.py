# SPDX-License-Identifier: Apache-2.0
"""Network workloads with exact counts of their own, run as separate processes (under `ip netns exec`) by
tests/test_net.py, and, for that test, NetPair (the two network namespaces they run in) and a few helpers. Each
workload prints one JSON line with what it did, as the socket API saw it.

    tcp_sink PORT REPLY_BYTES [ADDR]    accept one connection, read to EOF, send REPLY_BYTES back, close (listening
                                        on ADDR, IPv4 or IPv6; default 0.0.0.0)
    tcp_send HOST PORT NBYTES [WAIT]    connect, send NBYTES, shut down writing, read the reply to EOF; prints also
                                        the kernel's own count of this socket's retransmitted segments (TCP_INFO)
    udp_echo PORT REPLY_BYTES           answer every datagram with REPLY_BYTES bytes, until killed
    udp_ping HOST PORT COUNT SIZE [WAIT]  COUNT datagrams of SIZE bytes, one at a time, each waiting for its answer
    tcp_accept PORT N                   accept N connections one after the other, each read to EOF, then closed
    tcp_conns HOST PORT N SIZE [WAIT]   N connections one after the other: send SIZE, shut down, read to EOF
    tcp_flood HOST PORT                 connect and send until killed (a busy neighbour outside the job)
    udp_flood HOST PORT SIZE            send datagrams until killed

WAIT: "wait" to read one line from stdin before starting (so that a probe can attach to the process first).
Every listener prints {"ready": PORT} once it listens.
"""
import fcntl
import itertools
import json
import os
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

CHUNK = 64 * 1024
TCPI_TOTAL_RETRANS = 100   # offsets in struct tcp_info (<linux/tcp.h>): tcpi_total_retrans (u32),
TCPI_BYTES_RETRANS = 208   # tcpi_bytes_retrans (u64, 4.19+: payload bytes retransmitted)


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def maybe_wait(args: list[str]) -> None:
    if args and args[0] == "wait":
        sys.stdin.readline()


def retransmitted(s: socket.socket, settled: bool = False) -> dict[str, int]:
    """The socket's own account of its retransmissions: segments and payload bytes. settled: first wait until the
    peer has acknowledged everything sent, FIN included (TIOCOUTQ 0), so that no retransmission is still to come."""
    deadline = time.monotonic() + 10
    while settled and struct.unpack("i", fcntl.ioctl(s, termios.TIOCOUTQ, b"\0" * 4))[0] and \
            time.monotonic() < deadline:
        time.sleep(0.005)
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCPI_BYTES_RETRANS + 8)
    return {"retrans": struct.unpack_from("I", info, TCPI_TOTAL_RETRANS)[0],
            "retrans_bytes": struct.unpack_from("Q", info, TCPI_BYTES_RETRANS)[0]}


def drain(s: socket.socket) -> int:
    """Read until the peer's FIN; the number of bytes read."""
    got = 0
    while data := s.recv(CHUNK):
        got += len(data)
    return got


def tcp_sink(port: int, reply: int, addr: str = "0.0.0.0") -> None:
    ls = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port))
    ls.listen(8)
    say(ready=port)
    conn, peer = ls.accept()
    got = drain(conn)
    sent = 0
    while sent < reply:
        sent += conn.send(b"r" * min(CHUNK, reply - sent))
    conn.shutdown(socket.SHUT_WR)
    info = retransmitted(conn, settled=True)
    conn.close()
    ls.close()
    say(received=got, sent=sent, peer=peer[0], **info)


TCPI_RTT = 68              # tcpi_rtt (u32, µs): the socket's smoothed RTT


def tcp_send(host: str, port: int, nbytes: int) -> None:
    s = socket.create_connection((host, port))
    buf = b"x" * CHUNK
    sent = 0
    rtts = []            # the socket's own smoothed RTT, read after every send (the probe reads it per skb sent)
    while sent < nbytes:
        sent += s.send(buf[:min(CHUNK, nbytes - sent)])
        rtts.append(struct.unpack_from("I", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), TCPI_RTT)[0])
    s.shutdown(socket.SHUT_WR)
    got = drain(s)
    info = retransmitted(s)
    s.close()
    say(sent=sent, received=got, rtt_us=sorted(rtts)[len(rtts) // 2], rtt_mean_us=sum(rtts) / max(1, len(rtts)),
        **info)


def udp_echo(port: int, reply: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    say(ready=port)
    while True:
        _, peer = s.recvfrom(65536)
        s.sendto(b"e" * reply, peer)


def udp_ping(host: str, port: int, count: int, size: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    got = got_bytes = 0
    for _ in range(count):
        s.sendto(b"u" * size, (host, port))
        try:
            got_bytes += len(s.recv(65536))
            got += 1
        except socket.timeout:   # a lost answer is simply not counted: the test compares with what arrived
            pass
    s.close()
    say(sent=count, sent_bytes=count * size, received=got, received_bytes=got_bytes)


def tcp_accept(port: int, n: int) -> None:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(n)
    say(ready=port)
    got = 0
    for _ in range(n):
        conn, _ = ls.accept()
        while data := conn.recv(CHUNK):
            got += len(data)
        conn.close()
    ls.close()
    say(accepted=n, received=got)


def tcp_conns(host: str, port: int, n: int, size: int) -> None:
    for _ in range(n):
        s = socket.create_connection((host, port))
        s.sendall(b"c" * size)
        s.shutdown(socket.SHUT_WR)
        while s.recv(CHUNK):
            pass
        s.close()
    say(connections=n, sent=n * size)


def tcp_flood(host: str, port: int) -> None:
    s = socket.create_connection((host, port))
    buf = b"n" * CHUNK
    try:
        while True:
            s.sendall(buf)
    except OSError:              # the receiver is gone (the test is over)
        pass


def udp_flood(host: str, port: int, size: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    buf = b"n" * size
    while True:
        try:
            s.sendto(buf, (host, port))
        except OSError:          # ECONNREFUSED from an ICMP error, ENOBUFS: a flood goes on regardless
            pass


# ---------------------------------------------------------------- for tests/test_net.py: the namespaces, references

WL = str(Path(__file__).resolve())
ADDR_A, ADDR_B = "10.213.0.1", "10.213.0.2"
_tags = itertools.count()


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


class NetPair:
    """Namespaces A and B joined by veth va <-> vb, static neighbours, IPv6 off: only the test's packets cross."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}x{next(_tags)}"
        self.a, self.b, self.va, self.vb = f"jpa{tag}", f"jpb{tag}", f"jva{tag}", f"jvb{tag}"
        self.procs: list[subprocess.Popen] = []
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        for ns in (self.a, self.b):
            self.run(ns, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; "
                                     "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
        sh("ip", "link", "add", self.va, "address", "02:00:0a:d5:00:01", "netns", self.a, "type", "veth",
           "peer", "name", self.vb, "address", "02:00:0a:d5:00:02", "netns", self.b)
        for ns, dev, addr, peer, mac in ((self.a, self.va, ADDR_A, ADDR_B, "02:00:0a:d5:00:02"),
                                         (self.b, self.vb, ADDR_B, ADDR_A, "02:00:0a:d5:00:01")):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "neigh", "replace", peer, "lladdr", mac, "dev", dev, "nud", "permanent")

    def run(self, ns: str, *argv: str) -> str:
        return sh("ip", "netns", "exec", ns, *argv)

    def argv(self, ns: str, workload: str, *args) -> list[str]:
        return ["ip", "netns", "exec", ns, sys.executable, WL, workload, *map(str, args)]

    def start(self, ns: str, workload: str, *args, spawn=subprocess.Popen, ready: bool = False,
              **kw) -> subprocess.Popen:
        p = spawn(self.argv(ns, workload, *args), stdout=subprocess.PIPE, text=True, **kw)
        self.procs.append(p)
        if ready:
            assert "ready" in json.loads(p.stdout.readline()), f"{workload} did not start"
        return p

    def veth_a(self) -> dict[str, int]:
        names = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
        vals = self.run(self.a, "sh", "-c", f"cd /sys/class/net/{self.va}/statistics && cat {' '.join(names)}")
        return dict(zip(names, map(int, vals.split())))

    def snmp(self, ns: str) -> dict[str, int]:
        """A namespace's own TCP and UDP counters (/proc/net/snmp, read from inside it). OutSegs counts segments
        (a GSO skb as its segments), InSegs counts skbs as they arrive (a GSO skb from the veth as one)."""
        lines = [ln.split() for ln in self.run(ns, "cat", "/proc/net/snmp").splitlines()]
        out = {}
        for head, vals in zip(lines[::2], lines[1::2]):
            if head[0] in ("Tcp:", "Udp:"):
                out.update({f"{head[0][:-1]}{k}": int(v) for k, v in zip(head[1:], vals[1:])})
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def near(got: int, want: int, tol: float = 0.02) -> bool:
    return abs(got - want) <= tol * want


TCP_HDRS = 14 + 20 + 32   # Ethernet + IPv4 + TCP with the timestamp option, once per skb crossing the veth
UDP_HDRS = 14 + 20 + 8




DROP = r"""
/* Test only: drops every 10th full-size TCP segment arriving at the receiver's sockets, 40 times at most. */
BPF_ARRAY(seen, u64, 2);
int drop_some(struct __sk_buff *skb)
{
    if (skb->len < 1000)
        return 1;
    u32 k = 0;
    u64 *n = seen.lookup(&k);
    if (!n)
        return 1;
    u64 v = __sync_fetch_and_add(n, 1);
    if (v % 10 != 9 || v >= 400)
        return 1;
    k = 1;
    u64 *d = seen.lookup(&k);
    if (d)
        __sync_fetch_and_add(d, 1);
    return 0;
}
"""


REFUSE_RETRANSMITS = r"""
/* Test only, on the sender's group (egress): each full-size TCP segment sent a second time (its sequence number seen
 * before: a retransmit) is refused once — the drop is the cgroup hook's, inside the sender's transmit, so the kernel
 * has counted the retransmit and its transmit fails (-EPERM), as a full qdisc or veth backlog makes it fail. */
BPF_HASH(sent, u32, u8, 8192);
BPF_ARRAY(refused, u64, 1);
int refuse_first_retransmit(struct __sk_buff *skb)
{
    if (skb->len < 1000 || skb->protocol != bpf_htons(0x0800))
        return 1;
    u8 vihl = 0, proto = 0;
    if (bpf_skb_load_bytes(skb, 0, &vihl, 1) || bpf_skb_load_bytes(skb, 9, &proto, 1) || proto != 6)
        return 1;
    u32 seq = 0;
    if (bpf_skb_load_bytes(skb, (vihl & 0x0f) * 4 + 4, &seq, 4))
        return 1;
    u8 *state = sent.lookup(&seq);
    if (!state) {
        u8 first = 1;
        sent.update(&seq, &first);
        return 1;
    }
    if (*state == 1) {           /* its first retransmit: refused */
        *state = 2;
        u32 k = 0;
        u64 *n = refused.lookup(&k);
        if (n)
            __sync_fetch_and_add(n, 1);
        return 0;
    }
    return 1;
}
"""

if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "tcp_sink":
        tcp_sink(int(args[0]), int(args[1]), *args[2:])
    elif what == "tcp_send":
        maybe_wait(args[3:])
        tcp_send(args[0], int(args[1]), int(args[2]))
    elif what == "udp_echo":
        udp_echo(int(args[0]), int(args[1]))
    elif what == "udp_ping":
        maybe_wait(args[4:])
        udp_ping(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif what == "tcp_accept":
        tcp_accept(int(args[0]), int(args[1]))
    elif what == "tcp_conns":
        maybe_wait(args[4:])
        tcp_conns(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif what == "tcp_flood":
        tcp_flood(args[0], int(args[1]))
    elif what == "udp_flood":
        udp_flood(args[0], int(args[1]), int(args[2]))
    else:
        sys.exit(f"unknown workload {what}")
