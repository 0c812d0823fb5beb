// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* net.c — a job's TCP and UDP traffic: bytes, packets, retransmits, connection opens and closes, top peers.
 *
 * Two ways to see the job's traffic, chosen by probes/net.py per target:
 *   packets   (cgroup targets) net_ingress / net_egress, BPF_PROG_TYPE_CGROUP_SKB linked to the job's cgroup2
 *             directory: they run for exactly the packets of sockets that belong to the job's groups, on the way
 *             into a socket (after IP reassembly, before the socket queue) and out of the IP layer (before
 *             fragmentation and GSO segmentation). Bytes are L4 payload (IP, TCP, UDP headers left out: the same
 *             meaning as at the syscalls); packets are wire segments (a GSO/GRO skb counts gso_segs).
 *   syscalls  (PID-tree targets, or when cgroup links are refused) sock:sock_send_length / sock_recv_length, in
 *             the sending or receiving thread's own context: payload bytes that the job's send/recv calls moved,
 *             by protocol; no packet counts, no retransmitted bytes. Compiled with -DCOUNT_SYSCALL_BYTES.
 * Both: sock:inet_sock_set_state counts TCP active opens (connect: SYN_SENT, in the caller's context), passive
 *   opens and closes, and remembers, per socket address, the job slot and the peer (forgotten at
 *   tcp:tcp_destroy_sock where it exists, else at TCP_CLOSE); tcp:tcp_retransmit_skb (which
 *   runs in timer/softirq context, where "current" means nothing) finds the owner through that map. A socket
 *   learns its slot when a member connects on it or sends/receives on it (sock_*_length); an accepted socket,
 *   established in softirq, waits as "pending" until its owner first uses or closes it, and is counted as a
 *   passive open then.
 * Only tracepoint arguments, packet bytes (bpf_skb_load_bytes) and helpers are read, never kernel structs.
 * Oldest kernel: 4.16 (inet_sock_set_state with protocol); packets path 5.7 (BPF_LINK_CREATE for cgroups);
 *   syscalls path and socket learning 6.3 (sock_send_length). tcp_retransmit_skb's err field (recent kernels) is
 *   honoured where the format file has it (-DRETRANS_HAS_ERR): an attempt that gave up before the kernel counted
 *   it is no retransmit; one whose transmit failed after it was counted is one, as TCP_INFO and RetransSegs say.
 * Cost (bpf_stats, 2-core 6.18 VM): the skb programs run only for the job's packets: 2-3 skb loads, 2 lookups,
 *   one atomic add to the peer table, ~150-160 ns per skb (one run per GSO/GRO skb, not per segment).
 *   sock_*_length runs on every send/recv call of the node (AF_UNIX too): a family check, then the membership
 *   lookup, ~50-150 ns; ~190 ns for a member's call when counting bytes. inet_sock_set_state ~90-100 ns per TCP
 *   state change of the node; tcp_destroy_sock ~115 ns; tcp_retransmit_skb one lookup.
 * Memory: socks 16 Ki entries (LRU), peers 2 Ki (LRU), stats one struct per slot per CPU.
 */
#define MAX_SOCKS 16384
#define MAX_PEERS 2048
#define NO_SLOT 0xffffffff

/* Stable UAPI numbers, spelled out so that no kernel header is needed for them. */
#define NET_AF_INET 2
#define NET_AF_INET6 10
#define NET_IPPROTO_TCP 6
#define NET_IPPROTO_UDP 17
#define NET_ETH_P_IP 0x0800
#define NET_ETH_P_IPV6 0x86DD
#define NET_MSG_PEEK 2
#define IP6_HOPOPTS 0
#define IP6_ROUTING 43
#define IP6_FRAGMENT 44
#define IP6_DSTOPTS 60
#define NET_TCP_ESTABLISHED 1
#define NET_TCP_SYN_SENT 2
#define NET_TCP_SYN_RECV 3
#define NET_TCP_FIN_WAIT1 4
#define NET_TCP_CLOSE 7
#define NET_TCP_LAST_ACK 9

struct net_stats {
    u64 tcp_tx_bytes;
    u64 tcp_rx_bytes;
    u64 udp_tx_bytes;
    u64 udp_rx_bytes;
    u64 tcp_tx_packets;
    u64 tcp_rx_packets;
    u64 udp_tx_packets;
    u64 udp_rx_packets;
    u64 tcp_retransmits;
    u64 tcp_active_opens;
    u64 tcp_passive_opens;
    u64 tcp_closes;
    u64 tcp_srtt_sum_us;    /* egress: the sending socket's smoothed RTT, summed per skb sent ... */
    u64 tcp_srtt_skbs;      /* ... and the skbs it was summed over */
};

/* A peer of a job: its address and the "service" port, the lower of the two ports of the flow (the server's in
 * the usual ephemeral-port setup), so that a server's many clients do not each take an entry per connection. */
struct peer_key {
    u32 slot;
    u16 family;
    u16 port;          /* host order */
    u8 addr[16];       /* IPv4 in the first 4 bytes */
};

/* The lower non-zero port (at SYN_SENT the local port is not bound yet: 0). */
#define SERVICE_PORT(a, b) ((a) && ((a) < (b) || !(b)) ? (a) : (b))

struct peer_val {
    u64 tx_bytes;
    u64 rx_bytes;
};

struct sock_info {
    u32 slot;          /* NO_SLOT: an accepted socket whose owner is not known yet */
    u16 family;        /* of the peer below; 0: unknown */
    u16 port;
    u8 addr[16];
};

BPF_PERCPU_ARRAY(stats, struct net_stats, 64);   /* 64 == MAX_SLOTS, checked below */
/* Shared, not per-CPU: read whole every tick, and a per-CPU table would cost entries x possible CPUs to read.
 * Adds are atomic. LRU: a job talking to thousands of peers keeps the busiest, never fails an insert. */
BPF_TABLE("lru_hash", struct peer_key, struct peer_val, peers, MAX_PEERS);
/* TCP socket address -> owner and peer, for hooks that run outside the owner's context. An entry goes when the
 * socket is destroyed (tcp_destroy_sock), or at TCP_CLOSE on kernels without that tracepoint. LRU, as a bound for
 * what slips through; an address reused by a new TCP socket is overwritten or deleted at its SYN_SENT or
 * SYN_RECV->ESTABLISHED, so a stale owner is never inherited. */
BPF_TABLE("lru_hash", u64, struct sock_info, socks, MAX_SOCKS);

#include "common.h"

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif

static inline struct net_stats *stats_of(u32 slot)
{
    return stats.lookup(&slot);
}

static inline void peer_add(struct peer_key *pk, u64 bytes, int tx)
{
    if (bytes == 0)
        return;
    struct peer_val *pv = peers.lookup(pk);
    if (!pv) {
        struct peer_val zero = {};
        peers.insert(pk, &zero);     /* NOEXIST: a racing CPU's fresh entry (and its add) is kept */
        pv = peers.lookup(pk);
        if (!pv)
            return;
    }
    if (tx)
        __sync_fetch_and_add(&pv->tx_bytes, bytes);
    else
        __sync_fetch_and_add(&pv->rx_bytes, bytes);
}

/* ---- packets path: cgroup skb programs ------------------------------------------------------------------- */

struct ip4_wire {       /* RFC 791 header, first 20 bytes */
    u8 ver_ihl;
    u8 tos;
    u16 tot_len;
    u16 id;
    u16 frag;
    u8 ttl;
    u8 proto;
    u16 csum;
    u8 saddr[4];
    u8 daddr[4];
};

static inline int count_skb(struct __sk_buff *skb, int tx)
{
    /* The socket's group, not current's: ingress runs in softirq. Only the job's groups' sockets reach here
     * (the link is on its directory), but one program may serve several jobs, so the slot is looked up. */
    u64 cg = bpf_skb_cgroup_id(skb);
    u32 *slotp = job_of_cgroup.lookup(&cg);
    if (!slotp || *slotp >= MAX_SLOTS)
        return 1;
    struct peer_key pk = {};
    pk.slot = *slotp;
    u32 l4off;
    u8 proto;
    int l4 = 1;        /* 0 for a non-first IPv4 fragment: no L4 header in it */
    /* data starts at the network header in both directions (the hook pushes back to it). */
    if (skb->protocol == bpf_htons(NET_ETH_P_IP)) {
        struct ip4_wire ip;
        if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0)
            return 1;
        proto = ip.proto;
        l4off = (ip.ver_ihl & 0xf) * 4;
        l4 = (bpf_ntohs(ip.frag) & 0x1fff) == 0;
        pk.family = NET_AF_INET;
        __builtin_memcpy(pk.addr, tx ? ip.daddr : ip.saddr, 4);
    } else if (skb->protocol == bpf_htons(NET_ETH_P_IPV6)) {
        u8 ip6[40];
        if (bpf_skb_load_bytes(skb, 0, ip6, sizeof(ip6)) < 0)
            return 1;
        proto = ip6[6];
        l4off = 40;
        /* Extension headers, a few deep: BIG TCP (IPv6 GSO skbs over 64 KiB, e.g. on loopback) carries a
         * Hop-by-Hop jumbo header on the way out. */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (proto != IP6_HOPOPTS && proto != IP6_ROUTING && proto != IP6_DSTOPTS && proto != IP6_FRAGMENT)
                break;
            u8 ext[4];
            if (bpf_skb_load_bytes(skb, l4off, ext, sizeof(ext)) < 0)
                return 1;
            if (proto == IP6_FRAGMENT) {
                if (((ext[2] << 8) | ext[3]) & 0xfff8)
                    l4 = 0;             /* not the first fragment */
                l4off += 8;
            } else {
                l4off += (ext[1] + 1) * 8;
            }
            proto = ext[0];
        }
        pk.family = NET_AF_INET6;
        __builtin_memcpy(pk.addr, tx ? &ip6[24] : &ip6[8], 16);
    } else {
        return 1;
    }
    if (proto != NET_IPPROTO_TCP && proto != NET_IPPROTO_UDP)
        return 1;
    u32 hdr = 0;
    if (l4) {
        u16 ports[2];
        if (bpf_skb_load_bytes(skb, l4off, ports, sizeof(ports)) < 0)
            return 1;
        u16 sport = bpf_ntohs(ports[0]), dport = bpf_ntohs(ports[1]);
        pk.port = SERVICE_PORT(sport, dport);
        hdr = 8;
        if (proto == NET_IPPROTO_TCP) {
            u8 doff;
            if (bpf_skb_load_bytes(skb, l4off + 12, &doff, 1) < 0)
                return 1;
            hdr = (doff >> 4) * 4;
        }
    }
    u32 len = skb->len, head = l4off + hdr;
    u64 payload = len > head ? len - head : 0;
    u64 segs = skb->gso_segs ? skb->gso_segs : 1;
    struct net_stats *s = stats_of(pk.slot);
    if (!s)
        return 1;
    if (proto == NET_IPPROTO_TCP) {
        if (tx) {
            /* The sender's view of the path: its socket's smoothed RTT (bpf_tcp_sock, Linux 5.1+). A queue on a
             * slow or shaped link shows here long before anything is lost. */
            struct bpf_sock *sk = skb->sk;
            if (sk)
                sk = bpf_sk_fullsock(sk);
            if (sk) {
                struct bpf_tcp_sock *tp = bpf_tcp_sock(sk);
                if (tp && tp->srtt_us) {
                    s->tcp_srtt_sum_us += tp->srtt_us >> 3;      /* kept << 3 by the kernel */
                    s->tcp_srtt_skbs += 1;
                }
            }
        }
        if (tx) { s->tcp_tx_bytes += payload; s->tcp_tx_packets += segs; }
        else    { s->tcp_rx_bytes += payload; s->tcp_rx_packets += segs; }
    } else {
        if (tx) { s->udp_tx_bytes += payload; s->udp_tx_packets += segs; }
        else    { s->udp_rx_bytes += payload; s->udp_rx_packets += segs; }
    }
    peer_add(&pk, payload, tx);
    return 1;           /* observe only: never drop */
}

int net_ingress(struct __sk_buff *skb)
{
    return count_skb(skb, 0);
}

int net_egress(struct __sk_buff *skb)
{
    return count_skb(skb, 1);
}

/* ---- TCP state changes ----------------------------------------------------------------------------------- */

/* A macro, not a function: bcc makes the tracepoint's struct only for the program that takes it as argument. */
#define PEER_FROM_STATE(info, args) do {                                                            \
        u16 sport_ = (args)->sport, dport_ = (args)->dport;      /* host order in this tracepoint */ \
        (info)->port = SERVICE_PORT(sport_, dport_);                                                \
        (info)->family = (args)->family;                                                            \
        if ((args)->family == NET_AF_INET6)                                                         \
            __builtin_memcpy((info)->addr, (args)->daddr_v6, 16);                                   \
        else                                                                                        \
            __builtin_memcpy((info)->addr, (args)->daddr, 4);                                       \
    } while (0)

/* A pending accepted socket meets its owner (a member touching it in process context): count the open. */
static inline void claim(u64 sk, struct sock_info *info, u32 slot)
{
    struct sock_info mine = *info;
    struct net_stats *s;
    if (info->slot == NO_SLOT && (s = stats_of(slot)))
        s->tcp_passive_opens++;
    mine.slot = slot;
    socks.update(&sk, &mine);
}

/* TCP_CLOSE: often in softirq (the peer's FIN or RST), where a classic tracepoint program is skipped whenever it
 * interrupts another one (see RAW_SOFTIRQ_HOOKS below). Only sockets in the table count: that also keeps
 * non-TCP users of this tracepoint out when the raw program (no protocol argument) calls this. */
static inline void on_close(u64 sk)
{
    struct sock_info *info = socks.lookup(&sk);
    if (!info)
        return;
    struct net_stats *s;
    if (info->slot < MAX_SLOTS && (s = stats_of(info->slot)))
        s->tcp_closes++;
#ifndef HAVE_DESTROY
    socks.delete(&sk);   /* data still queued and read after this is no longer put to its peer */
#endif
}

int on_state(struct tracepoint__sock__inet_sock_set_state *args)
{
    if (args->protocol != NET_IPPROTO_TCP)
        return 0;
    u64 sk = (u64)args->skaddr;
    int newstate = args->newstate;
    if (newstate == NET_TCP_SYN_SENT) {
        /* connect(): the caller's context. Any old entry at this address belongs to a freed socket. */
        int slot = job_slot_current();
        if (slot < 0) {
            socks.delete(&sk);
            return 0;
        }
        struct sock_info info = {.slot = slot};
        PEER_FROM_STATE(&info, args);
        socks.update(&sk, &info);
        struct net_stats *s = stats_of(slot);
        if (s)
            s->tcp_active_opens++;
    } else if (newstate == NET_TCP_ESTABLISHED && args->oldstate == NET_TCP_SYN_RECV) {
        /* A child of a listener, made in softirq: its owner is whoever accepts it, known later. */
        struct sock_info info = {.slot = NO_SLOT};
        PEER_FROM_STATE(&info, args);
        socks.update(&sk, &info);
    } else if (newstate == NET_TCP_FIN_WAIT1 || newstate == NET_TCP_LAST_ACK) {
        /* Only close()/shutdown() make these: the owner's context. Claims an accepted socket never used. */
        struct sock_info *info = socks.lookup(&sk);
        if (info && info->slot == NO_SLOT) {
            int slot = job_slot_current();
            if (slot >= 0)
                claim(sk, info, slot);
        }
    }
#ifndef RAW_SOFTIRQ_HOOKS
    else if (newstate == NET_TCP_CLOSE) {
        on_close(sk);
    }
#endif
    return 0;
}

#ifdef RETRANS_HAS_ERR
/* The tracepoint fires with err for every attempt. The kernel counts a retransmit (the socket's total_retrans,
 * RetransSegs) before it transmits it: an attempt that gave up before that — the socket's memory full (-EAGAIN),
 * the original still in a host queue (-EBUSY), no memory to split or trim it (-ENOMEM) — is no retransmit; one whose
 * transmit failed after it (a qdisc or a veth backlog full, NET_XMIT_DROP; netfilter, -EPERM; -ENOBUFS) is one. A
 * CI run under load read 39 retransmits of the socket's 40 when every err was left out. */
#define RETRANS_COUNTED(err) ((err) != -NET_EAGAIN && (err) != -NET_EBUSY && (err) != -NET_ENOMEM)
#define NET_EAGAIN 11
#define NET_ENOMEM 12
#define NET_EBUSY 16
#endif

static inline void on_retransmitted(u64 sk)
{
    struct sock_info *info = socks.lookup(&sk);
    if (!info || info->slot >= MAX_SLOTS)
        return;
    struct net_stats *s = stats_of(info->slot);
    if (s)
        s->tcp_retransmits++;
}

#ifndef RAW_SOFTIRQ_HOOKS
#ifdef HAVE_DESTROY
/* The socket is freed: nothing can touch it any more. Its entry lives until here, not until TCP_CLOSE, because
 * the peer's FIN can close a socket whose owner has not read all of its data yet. */
int on_destroy(struct tracepoint__tcp__tcp_destroy_sock *args)
{
    u64 sk = (u64)args->skaddr;
    socks.delete(&sk);
    return 0;
}
#endif

int on_retransmit(struct tracepoint__tcp__tcp_retransmit_skb *args)
{
#ifdef RETRANS_HAS_ERR
    if (!RETRANS_COUNTED(args->err))
        return 0;
#endif
    on_retransmitted((u64)args->skaddr);
    return 0;
}

#else
/* RAW_SOFTIRQ_HOOKS (Linux 4.17+): the hooks that run in timer/softirq context as raw tracepoint programs. A
 * classic tracepoint program is skipped (counted only in its recursion_misses) when it fires while any other
 * classic tracepoint or kprobe program runs on the CPU, as when a softirq interrupts the sock_*_length program of
 * some process's recv call; a raw program is only guarded against itself. Measured before this: 1-5 of ~40-110
 * retransmits of a loaded 2-core VM missed, 19 of 196 once. Only the socket address (and err) is needed, which the
 * tracepoints' C arguments carry as they are: TP_PROTO(sk, skb[, err]), TP_PROTO(sk), TP_PROTO(sk, old, new). */
int on_retransmit_raw(struct bpf_raw_tracepoint_args *ctx)
{
#ifdef RETRANS_HAS_ERR
    if (!RETRANS_COUNTED((int)ctx->args[2]))
        return 0;
#endif
    on_retransmitted(ctx->args[0]);
    return 0;
}

#ifdef HAVE_DESTROY
int on_destroy_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 sk = ctx->args[0];
    socks.delete(&sk);
    return 0;
}
#endif

int on_state_raw(struct bpf_raw_tracepoint_args *ctx)
{
    if ((int)ctx->args[2] == NET_TCP_CLOSE)
        on_close(ctx->args[0]);
    return 0;
}
#endif

/* ---- syscalls: sock_send_length / sock_recv_length (process context) ------------------------------------- */
#ifdef HAVE_SOCK_LENGTH
static inline int on_length(u64 sk, u16 family, u16 protocol, int ret, int tx)
{
    if (family != NET_AF_INET && family != NET_AF_INET6)
        return 0;     /* AF_UNIX, netlink, ...: most of the node's calls end here */
#ifdef COUNT_SYSCALL_BYTES
    if (protocol != NET_IPPROTO_TCP && protocol != NET_IPPROTO_UDP)
        return 0;
#else
    if (protocol != NET_IPPROTO_TCP)
        return 0;     /* the packets path counts bytes; here only TCP sockets' owners are learned */
#endif
    /* A call that moved nothing (EOF, EPIPE) is the usual last call on a socket already CLOSEd: where entries go
     * at TCP_CLOSE (no tcp_destroy_sock), learning it again would leave its entry behind until LRU eviction. */
    if (ret <= 0)
        return 0;
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    struct sock_info *info = NULL;
    if (protocol == NET_IPPROTO_TCP) {
        info = socks.lookup(&sk);
        if (!info || info->slot != slot) {
            if (info) {
                claim(sk, info, slot);
            } else {   /* opened before the probe started: owner known now, peer not */
                struct sock_info fresh = {.slot = slot};
                socks.update(&sk, &fresh);
            }
            info = socks.lookup(&sk);
        }
    }
#ifdef COUNT_SYSCALL_BYTES
    struct net_stats *s = stats_of(slot);
    if (!s)
        return 0;
    if (protocol == NET_IPPROTO_TCP) {
        if (tx) s->tcp_tx_bytes += ret; else s->tcp_rx_bytes += ret;
    } else {
        if (tx) s->udp_tx_bytes += ret; else s->udp_rx_bytes += ret;
    }
    if (info && info->family) {
        struct peer_key pk = {.slot = slot, .family = info->family, .port = info->port};
        __builtin_memcpy(pk.addr, info->addr, 16);
        peer_add(&pk, ret, tx);
    }
#endif
    return 0;
}

int on_send(struct tracepoint__sock__sock_send_length *args)
{
    return on_length((u64)args->sk, args->family, args->protocol, args->ret, 1);
}

int on_recv(struct tracepoint__sock__sock_recv_length *args)
{
    if (args->flags & NET_MSG_PEEK)
        return 0;     /* peeked bytes stay queued: counted when really read */
    return on_length((u64)args->sk, args->family, args->protocol, args->ret, 0);
}
#endif
