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
 * Hooks: tracepoints block:block_io_start or block:block_bio_queue (+ block_bio_backmerge, block_split),
 *   block:block_bio_frontmerge, block:block_rq_merge, block:block_rq_issue, block:block_rq_complete; fork/exit
 *   from common.h. Only tracepoint arguments are read, never struct request/bio.
 * Oldest kernel: 4.18 (common.h; LRU hash 4.10); block_io_start mode 6.5.
 * Cost: issue and complete run for every request of the node: one hash lookup each, plus an update/delete for
 *   the job's; the submit hook runs job_slot_current() (1-2 lookups) per request (per bio in bio_queue mode).
 *   Measured (bpf_stats, 6.18 VM): ~0.65-1.5 µs per request of the job, ~0.35-0.6 µs per request of others.
 *   Memory: `inflight` is an LRU hash of MAX_INFLIGHT entries (~1.5 MiB preallocated): it cannot grow without
 *   bound, and user space also drops entries older than a minute (a request that never completes).
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
    u64 left;      /* bytes not yet completed, set at issue; a partial completion moves the entry forward */
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

/* Remember a job's read/write at the point of submission (the submitter's context). */
static inline int remember(u32 dev, u64 sector, u32 nr_sector, int op)
{
    if (op < 0 || nr_sector == 0)
        return 0;
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    struct rq_key key = {.sector = sector, .dev = dev};
    struct rq_val val = {.born_ns = bpf_ktime_get_ns(), .slot = slot, .op = op};
    inflight.update(&key, &val);
    return 0;
}

int on_io_start(struct tracepoint__block__block_io_start *args)
{
    return remember(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs));
}

int on_bio_queue(struct tracepoint__block__block_bio_queue *args)
{
    return remember(args->dev, args->sector, args->nr_sector, OP_OF(args->rwbs));
}

/* bio_queue mode: the bio joined the end of a request that has its own key; its own entry would never be used. */
int on_backmerge(struct tracepoint__block__block_bio_backmerge *args)
{
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    inflight.delete(&key);
    return 0;
}

/* The bio now starts the request, which began at sector + nr_sector: its owner moves to the new key, unless the
 * bio has an entry of its own (bio_queue mode), which then speaks for the request. */
int on_frontmerge(struct tracepoint__block__block_bio_frontmerge *args)
{
    struct rq_key old = {.sector = args->sector + args->nr_sector, .dev = args->dev};
    struct rq_val *v = inflight.lookup(&old);
    if (!v)
        return 0;
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    struct rq_val copy = *v;
    inflight.insert(&key, &copy);      /* insert: never overwrite the bio's own entry */
    inflight.delete(&old);
    return 0;
}

/* A request merged into the one before it (the elevator's request merge): only the survivor completes. */
int on_rq_merge(struct tracepoint__block__block_rq_merge *args)
{
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    inflight.delete(&key);
    return 0;
}

/* bio_queue mode: a bio too large for the device was split; the remainder (from new_sector) is resubmitted
 * without a second block_bio_queue, so it inherits the entry. */
int on_split(struct tracepoint__block__block_split *args)
{
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    struct rq_val *v = inflight.lookup(&key);
    if (!v)
        return 0;
    struct rq_key rest = {.sector = args->new_sector, .dev = args->dev};
    struct rq_val copy = *v;
    inflight.update(&rest, &copy);
    return 0;
}

/* Every request of the node passes here: one lookup, and the job's get their issue time and size. A requeued
 * request is issued again: its latency counts from the last issue. */
int on_rq_issue(struct tracepoint__block__block_rq_issue *args)
{
    if (args->nr_sector == 0 || OP_OF(args->rwbs) < 0)
        return 0;
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    struct rq_val *v = inflight.lookup(&key);
    if (!v)
        return 0;
    v->issue_ns = bpf_ktime_get_ns();
    v->left = (u64)args->nr_sector << 9;
    return 0;
}

/* A request that went through the flush machinery (PREFLUSH/FUA emulated with flushes) may report a second,
 * empty completion when the sequence ends: its entry is gone by then, and empty ones are skipped at once. */
int on_rq_complete(struct tracepoint__block__block_rq_complete *args)
{
    if (args->nr_sector == 0 || OP_OF(args->rwbs) < 0)
        return 0;
    struct rq_key key = {.sector = args->sector, .dev = args->dev};
    struct rq_val *v = inflight.lookup(&key);
    if (!v)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 done = (u64)args->nr_sector << 9;
    u32 slot = v->slot;
    struct slot_stats *s = stats.lookup(&slot);
    if (!s) {
        inflight.delete(&key);
        return 0;
    }
    struct dir_stats *d = v->op == OP_WRITE ? &s->dir[OP_WRITE] : &s->dir[OP_READ];
    if (args->error)
        d->errors++;
    else
        d->bytes += done;
    if (v->issue_ns && v->left > done) {
        /* Partial completion: the request's position has moved past `done` bytes; follow it. */
        struct rq_key next = {.sector = args->sector + args->nr_sector, .dev = args->dev};
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
