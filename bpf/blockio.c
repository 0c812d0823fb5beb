// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* blockio.c — a job's block I/O: requests, bytes and device latency (issue → complete), reads and writes apart.
 *
 * Attribution. A request is issued (block_rq_issue) and completed (block_rq_complete) in contexts that are often
 * not the job's (kblockd, another task's plug flush, interrupts), so the owner is decided where the I/O is
 * submitted, in the submitting task's own context, and remembered in `inflight`, keyed by (dev, sector):
 *   on_io_start   block:block_io_start (6.5+): a new request is made from a bio, in submit_bio's caller. Preferred:
 *                 one entry per request, splits need nothing, bio-based devices (dm, md) never make one.
 *   on_bio_queue  block:block_bio_queue (any kernel): one entry per bio; then on_backmerge drops the entries of
 *                 bios that joined an existing request and on_split adds the remainder of a split bio.
 * Both modes: on_frontmerge moves an entry when a bio becomes the new start of a request; on_rq_merge drops the
 * entry of a request absorbed by the one before it. The request as the device sees it (after merges) is what is
 * counted: one per final completion, with the latency from its (last) issue; bytes are counted at each
 * completion, so partial completions add up exactly. Bios of other jobs merged into a job's request count for
 * the job, and the other way round (merges need contiguous sectors: rare between unrelated processes).
 * Only reads and writes (an 'R' or 'W' in rwbs) with data are tracked: flushes, discards and zeroed-out ranges
 * are not, so a flush request's sector cannot match a write's key.
 * Not attributable here: buffered writes flushed by writeback kworkers, the journal (jbd2), readahead started by
 * another task: they are submitted outside the job's context. O_DIRECT and the job's own fsync are its own.
 * Hooks: block:block_io_start or block:block_bio_queue (+ block_bio_backmerge, block_split),
 *   block:block_bio_frontmerge, block:block_rq_merge, block:block_rq_issue, block:block_rq_complete; fork/exit
 *   from common.h. -DRAW_BLOCK (user space: raw tracepoints and BTF present): raw tracepoint programs (*_raw), which
 *   read struct request/bio/gendisk fields at offsets from the running kernel's BTF (-DRQ_SECTOR=… below). Why: the
 *   kernel skips a classic tracepoint program whenever any classic/kprobe BPF program already runs on that CPU
 *   (trace_call_bpf's bpf_prog_active), and block_rq_complete runs in softirq, interrupting submit and issue
 *   programs: 12-20k completions of the node missed in 10 s of fio inside and outside a job (6.18 VM), some of the
 *   job's. A raw program is skipped only when it re-enters itself on one CPU (a hard-irq completion interrupting
 *   on_rq_complete_raw). Without RAW_BLOCK: classic programs on the tracepoints' format records.
 * Oldest kernel: 4.18 (common.h; LRU hash 4.10); raw programs 5.11 (these prototypes; BTF); block_io_start 6.5.
 * Cost: issue and complete run for every request of the node: one hash lookup each (raw: after 4-5 field reads),
 *   plus an update/delete for the job's; the submit hook runs job_slot_current() (1-2 lookups) per request (per bio
 *   in bio_queue mode). Measured (bpf_stats, 6.18 VM, raw): ~1.1-1.4 µs per request of the job, less for others'
 *   (docs/PERFORMANCE.md).
 *   Memory: `inflight` is an LRU hash of MAX_INFLIGHT entries (~1.5 MiB preallocated): it cannot grow without
 *   bound, and user space also drops entries older than a minute (a request that never completes).
 * Completions the kernel never reports: under mixed load (CPU hogs and another task's O_DIRECT I/O on the same
 *   virtio disk, 6.18) about one request of a job in 3000 completes without block_rq_complete reaching any BPF
 *   program (a second, independent program on the tracepoint misses the same ones; recursion_misses stays 0): its
 *   entry stays here, issued. User space counts such entries, with their bytes, as given up — after a minute, or at
 *   once when the job has no process left (nothing of it can still be in flight) — so the shortfall is counted.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last: ≥ 2^26 µs */
#define MAX_INFLIGHT 16384
#define OP_READ 0
#define OP_WRITE 1

struct rq_key {
    u64 sector;
    u32 dev;
    u32 pad;       /* always 0: hashed with the rest */
};

struct rq_val {
    u64 born_ns;   /* when the entry was made: user space drops entries that outlive any sane request */
    u64 issue_ns;  /* last block_rq_issue; 0: not issued yet */
    u64 left;      /* bytes not yet completed: the bio's at submission, the request's at issue; a partial
                    * completion moves the entry forward */
    u32 slot;
    u32 op;        /* OP_READ / OP_WRITE */
};

struct dir_stats {
    u64 requests;  /* final completions */
    u64 bytes;     /* completed bytes, partial completions included */
    u64 lat_ns;    /* sum of issue → final completion */
    u64 errors;    /* completions with an error (their bytes are not counted) */
    u64 hist[NBUCKETS];
};

struct slot_stats {
    struct dir_stats dir[2];   /* OP_READ, OP_WRITE */
};

BPF_TABLE("lru_hash", struct rq_key, struct rq_val, inflight, MAX_INFLIGHT);
BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */

#include "common.h"

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif


/* rwbs is "[F]<op>[F][A][S][M]": the op letter is the first or second; 'R' and 'W' appear only as ops. */
#define OP_OF(rwbs) ((rwbs)[0] == 'R' || (rwbs)[1] == 'R' ? OP_READ : \
                     (rwbs)[0] == 'W' || (rwbs)[1] == 'W' ? OP_WRITE : -1)

/* ---- what each hook does, from plain values (the classic and raw programs below only gather them) ---------- */

/* Remember a job's read/write at the point of submission (the submitter's context). */
static inline int remember(u32 dev, u64 sector, u32 nr_sector, int op)
{
    if (op < 0 || nr_sector == 0)
        return 0;
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    struct rq_key key = {.sector = sector, .dev = dev};
    struct rq_val val = {.born_ns = bpf_ktime_get_ns(), .left = (u64)nr_sector << 9, .slot = slot, .op = op};
    inflight.update(&key, &val);
    return 0;
}

/* Drop the entry at (dev, sector). bio_queue mode's back merge: the bio joined the end of a request that has its own
 * key, so its own entry would never be used. Both modes' request merge: a request merged into the one before it
 * (the elevator's request merge); only the survivor completes. */
static inline int forget(u32 dev, u64 sector)
{
    struct rq_key key = {.sector = sector, .dev = dev};
    inflight.delete(&key);
    return 0;
}

/* The bio now starts the request, which began at sector + nr_sector: its owner moves to the new key, unless the
 * bio has an entry of its own (bio_queue mode), which then speaks for the request. */
static inline int front_merged(u32 dev, u64 sector, u32 nr_sector)
{
    struct rq_key old = {.sector = sector + nr_sector, .dev = dev};
    struct rq_val *v = inflight.lookup(&old);
    if (!v)
        return 0;
    struct rq_key key = {.sector = sector, .dev = dev};
    struct rq_val copy = *v;
    inflight.insert(&key, &copy);      /* insert: never overwrite the bio's own entry */
    inflight.delete(&old);
    return 0;
}

/* bio_queue mode: a bio too large for the device was split; the remainder (from new_sector) is resubmitted
 * without a second block_bio_queue, so it inherits the entry. */
static inline int split(u32 dev, u64 sector, u64 new_sector)
{
    struct rq_key key = {.sector = sector, .dev = dev};
    struct rq_val *v = inflight.lookup(&key);
    if (!v)
        return 0;
    struct rq_key rest = {.sector = new_sector, .dev = dev};
    struct rq_val copy = *v;
    inflight.update(&rest, &copy);
    return 0;
}

/* The job's entry of a request of the node, its key filled in (NULL: not the job's, or empty, or an operation not
 * counted). The caller's key starts zeroed (= {}): its padding is part of the hash's key. */
static inline struct rq_val *tracked(struct rq_key *key, u32 dev, u64 sector, u32 nr_sector, int op)
{
    if (nr_sector == 0 || op < 0)
        return NULL;
    key->sector = sector;
    key->dev = dev;
    return inflight.lookup(key);
}

/* Every request of the node passes here: one lookup, and the job's get their issue time and size. A requeued
 * request is issued again: its latency counts from the last issue. */
static inline int issued(u32 dev, u64 sector, u32 nr_sector, int op)
{
    struct rq_key key = {};
    struct rq_val *v = tracked(&key, dev, sector, nr_sector, op);
    if (!v)
        return 0;
    v->issue_ns = bpf_ktime_get_ns();
    v->left = (u64)nr_sector << 9;
    return 0;
}

/* A request that went through the flush machinery (PREFLUSH/FUA emulated with flushes) may report a second,
 * empty completion when the sequence ends: its entry is gone by then, and empty ones are skipped at once. */
static inline int completed(u32 dev, u64 sector, u32 nr_sector, int op, int error)
{
    struct rq_key key = {};
    struct rq_val *v = tracked(&key, dev, sector, nr_sector, op);
    if (!v)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 done = (u64)nr_sector << 9;
    u32 slot = v->slot;
    struct slot_stats *s = stats.lookup(&slot);
    if (!s) {
        inflight.delete(&key);
        return 0;
    }
    struct dir_stats *d = v->op == OP_WRITE ? &s->dir[OP_WRITE] : &s->dir[OP_READ];
    if (error)
        d->errors++;
    else
        d->bytes += done;
    if (v->issue_ns && v->left > done) {
        /* Partial completion: the request's position has moved past `done` bytes; follow it. */
        struct rq_key next = {.sector = sector + nr_sector, .dev = dev};
        struct rq_val rest = *v;
        rest.left -= done;
        inflight.update(&next, &rest);
        inflight.delete(&key);
        return 0;
    }
    d->requests++;
    if (v->issue_ns && now >= v->issue_ns) {
        u64 lat = now - v->issue_ns;
        u32 b = log2_floor(lat / 1000);
        if (b >= NBUCKETS)
            b = NBUCKETS - 1;
        d->lat_ns += lat;
        d->hist[b]++;
    }
    inflight.delete(&key);
    return 0;
}

#ifdef RAW_BLOCK
/* ---- raw tracepoint programs (default where the kernel has them): the arguments are struct request / bio
 * pointers (TP_PROTO of 5.11+, checked against the kernel's BTF by user space), read at the byte offsets user space
 * took from the running kernel's BTF (-DRQ_SECTOR=…), never from the headers bcc compiles with. The values are
 * those the classic records hold: dev = disk_devt(q->disk) (bio_dev() for bios), sector = blk_rq_pos(),
 * nr_sector = blk_rq_sectors() (nr_bytes >> 9 at completion), the op = the low 8 bits of cmd_flags/bi_opf
 * (REQ_OP_READ 0, REQ_OP_WRITE 1: what rwbs' 'R' and 'W' say). */
#define READ_AT(ptr, off, type) ({ type _v = 0; bpf_probe_read_kernel(&_v, sizeof(_v), (void *)((ptr) + (off))); _v; })
#define REQ_OP_MASK 0xff
#define OP_OF_FLAGS(f) (((f) & REQ_OP_MASK) == 0 ? OP_READ : ((f) & REQ_OP_MASK) == 1 ? OP_WRITE : -1)

static inline u32 disk_dev(u64 disk)
{
    if (!disk)
        return 0;
#if DISK_FIRST_MINOR == DISK_MAJOR + 4
    u64 both = READ_AT(disk, DISK_MAJOR, u64);          /* int major; int first_minor; side by side: one read */
    return ((u32)both << 20) | (u32)(both >> 32);       /* MKDEV(major, first_minor); little-endian */
#else
    return ((u32)READ_AT(disk, DISK_MAJOR, int) << 20) | (u32)READ_AT(disk, DISK_FIRST_MINOR, int);   /* MKDEV */
#endif
}

static inline u32 rq_dev(u64 rq)
{
    return disk_dev(READ_AT(READ_AT(rq, RQ_Q, u64), Q_DISK, u64));
}

static inline u32 bio_dev(u64 bio)
{
    return disk_dev(READ_AT(READ_AT(bio, BIO_BDEV, u64), BDEV_DISK, u64));
}

int on_io_start_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 rq = ctx->args[0];
    return remember(rq_dev(rq), READ_AT(rq, RQ_SECTOR, u64), READ_AT(rq, RQ_DATA_LEN, u32) >> 9,
                    OP_OF_FLAGS(READ_AT(rq, RQ_CMD_FLAGS, u32)));
}

int on_bio_queue_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 bio = ctx->args[0];
    return remember(bio_dev(bio), READ_AT(bio, BIO_SECTOR, u64), READ_AT(bio, BIO_SIZE, u32) >> 9,
                    OP_OF_FLAGS(READ_AT(bio, BIO_OPF, u32)));
}

int on_backmerge_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 bio = ctx->args[0];
    return forget(bio_dev(bio), READ_AT(bio, BIO_SECTOR, u64));
}

int on_frontmerge_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 bio = ctx->args[0];
    return front_merged(bio_dev(bio), READ_AT(bio, BIO_SECTOR, u64), READ_AT(bio, BIO_SIZE, u32) >> 9);
}

int on_rq_merge_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 rq = ctx->args[0];
    return forget(rq_dev(rq), READ_AT(rq, RQ_SECTOR, u64));
}

/* TP_PROTO(struct bio *bio, unsigned int new_sector) */
int on_split_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 bio = ctx->args[0];
    return split(bio_dev(bio), READ_AT(bio, BIO_SECTOR, u64), (u32)ctx->args[1]);
}

/* Cheapest first: most requests of the node are not the job's, and a read/write with data is all that counts. */
int on_rq_issue_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 rq = ctx->args[0];
    int op = OP_OF_FLAGS(READ_AT(rq, RQ_CMD_FLAGS, u32));
    if (op < 0)
        return 0;
    return issued(rq_dev(rq), READ_AT(rq, RQ_SECTOR, u64), READ_AT(rq, RQ_DATA_LEN, u32) >> 9, op);
}

/* TP_PROTO(struct request *rq, blk_status_t error, unsigned int nr_bytes); runs in softirq or hardirq context. */
int on_rq_complete_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u64 rq = ctx->args[0];
    int op = OP_OF_FLAGS(READ_AT(rq, RQ_CMD_FLAGS, u32));
    u32 nr_sector = (u32)ctx->args[2] >> 9;
    if (op < 0 || nr_sector == 0)
        return 0;
    return completed(rq_dev(rq), READ_AT(rq, RQ_SECTOR, u64), nr_sector, op, (u8)ctx->args[1] != 0);
}

#else
/* ---- classic tracepoint programs (kernels without raw tracepoints or BTF): the tracepoints' format records ---- */

int on_io_start(struct tracepoint__block__block_io_start *args)
{
    return remember(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs));
}

int on_bio_queue(struct tracepoint__block__block_bio_queue *args)
{
    return remember(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs));
}

int on_backmerge(struct tracepoint__block__block_bio_backmerge *args)
{
    return forget(args->dev, args->sector);
}

int on_frontmerge(struct tracepoint__block__block_bio_frontmerge *args)
{
    return front_merged(args->dev, args->sector, args->nr_sector);
}

int on_rq_merge(struct tracepoint__block__block_rq_merge *args)
{
    return forget(args->dev, args->sector);
}

int on_split(struct tracepoint__block__block_split *args)
{
    return split(args->dev, args->sector, args->new_sector);
}

int on_rq_issue(struct tracepoint__block__block_rq_issue *args)
{
    return issued(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs));
}

int on_rq_complete(struct tracepoint__block__block_rq_complete *args)
{
    return completed(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs), args->error);
}
#endif
