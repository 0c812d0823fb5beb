// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* memory.c — what memory pressure does to a job: page faults, reclaim and compaction stalls, OOM kills.
 *
 * Per job slot, summed in the kernel into one per-CPU struct (user space reads one element per tick):
 *   page faults: hardware faults on user addresses, from user or kernel mode (exceptions:page_fault_user,
 *     exceptions:page_fault_kernel with a user-half address) — the same faults perf's page-faults event counts;
 *   accounted faults and major faults: the kernel's own PGFAULT / PGMAJFAULT events (memcg:count_memcg_events,
 *     item numbers from BTF, given by user space as -DPGFAULT_ITEM / -DPGMAJFAULT_ITEM); minor = PGFAULT - majors;
 *   direct reclaim, memcg reclaim, compaction: stalls of the job's own threads (begin/end pairs run in the
 *     stalled task's context), count and ns, reclaim durations as a log2 µs histogram, pages reclaimed;
 *   OOM kills: oom:mark_victim records the victim in a small hash that user space drains every tick (no
 *     per-event output). The victim's job is decided here: by its pid in job_of_tgid when marked, else when it
 *     exits (sched_process_exit runs in the victim's own context, where its cgroup2 id is still current).
 * Hooks: the tracepoints above plus vmscan:mm_vmscan_{direct,memcg}_reclaim_{begin,end},
 *   compaction:mm_compaction_{begin,end}; fork/exit from common.h. Each part is compiled in only where user space
 *   found its tracepoints (-DHAVE_FAULTS, -DHAVE_MEMCG_EVENTS, -DHAVE_DIRECT_RECLAIM, -DHAVE_MEMCG_RECLAIM,
 *   -DHAVE_COMPACTION, -DHAVE_OOM). Only tracepoint arguments and helpers are read, never task_struct.
 * Oldest kernel: 4.18 (common.h); exceptions:* is x86 only; memcg:count_memcg_events appeared in 6.14;
 *   mark_victim carries comm and RSS since 6.8 (-DOOM_HAS_* per field found in its format file).
 * Cost: one program run per page fault (two with the memcg events: one for the fault, one for PGFAULT), each a
 *   membership lookup (1-2 hash lookups) and a per-CPU increment; count_memcg_events also fires for other memcg
 *   events (LRU activations, scans...), which return after one compare. Stalls: one hash update + delete per
 *   stall of a job thread. Measured numbers: probes/memory.py.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last ≥ 2^26 */
#ifndef MAX_STALLED
#define MAX_STALLED 10240      /* threads in a reclaim/compaction stall at once, node-wide (a test makes it smaller) */
#endif
#define MAX_OOM 256            /* OOM victims between two ticks */
#define SLOT_PENDING -2        /* victim's job not known yet: decided at its exit, or by user space */
#define SLOT_NONE -1           /* victim belonged to no watched job */

enum stall_kind { STALL_DIRECT = 1, STALL_MEMCG = 2, STALL_COMPACT = 3 };

struct slot_stats {
    u64 faults;
    u64 acct_faults;
    u64 major_faults;
    u64 direct_reclaim;
    u64 direct_reclaim_ns;
    u64 memcg_reclaim;
    u64 memcg_reclaim_ns;
    u64 reclaimed_pages;
    u64 compaction;
    u64 compaction_ns;
    u64 untracked_stalls;      /* stalls begun while `stalls` was full: not timed, not counted above */
    u64 reclaim_hist[NBUCKETS];
};

struct stall {
    u64 begin_ns;
    u32 slot;
};

struct oom_rec {
    u64 ts_ns;               /* bpf_ktime_get_ns (CLOCK_MONOTONIC) when marked */
    s32 slot;                /* SLOT_PENDING, SLOT_NONE or a job slot */
    u32 pid;
    u64 total_vm_kb;
    u64 anon_rss_kb;
    u64 file_rss_kb;
    u64 shmem_rss_kb;
    u64 pgtables_kb;
    u32 uid;
    s32 oom_score_adj;
    char comm[16];
};

BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */
BPF_HASH(stalls, u64, struct stall, MAX_STALLED); /* (kind << 32 | tid) → begin */
BPF_HASH(oom_victims, u32, struct oom_rec, MAX_OOM);

/* The victim's exit decides its job when its mark did not (cgroup targets: only the task itself can tell its
 * cgroup2 id without reading task_struct). common.h deletes the tgid key just before calling this, so only the
 * cgroup map is asked here; pid-tree victims were decided at mark time. */
static inline int job_slot_current(void);
#define JOB_ON_EXIT_HOOK
static inline void job_exit_hook(u32 tid)
{
#ifdef HAVE_OOM
    struct oom_rec *rec = oom_victims.lookup(&tid);
    if (rec && rec->slot == SLOT_PENDING) {
        int slot = job_slot_current();
        rec->slot = slot >= 0 ? slot : SLOT_NONE;
    }
#endif
}

#include "common.h"

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif

static inline struct slot_stats *current_stats(void)
{
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    u32 key = slot;
    return stats.lookup(&key);
}


/* ---- page faults ------------------------------------------------------------------------------------------ */
#ifdef HAVE_FAULTS
/* Kernel-half addresses go to do_kern_addr_fault, which the kernel does not count as a page fault (perf does not
 * either); the top bit tells the halves apart with 4- and 5-level paging alike. */
static inline void count_fault(unsigned long address)
{
    if (address >> 63)
        return;
    struct slot_stats *s = current_stats();
    if (s)
        s->faults++;
}

int on_fault_user(struct tracepoint__exceptions__page_fault_user *args)
{
    count_fault(args->address);
    return 0;
}

/* Kernel mode touching user memory (copy_to_user into a fresh buffer, a read() into untouched pages). */
int on_fault_kernel(struct tracepoint__exceptions__page_fault_kernel *args)
{
    count_fault(args->address);
    return 0;
}
#endif

#ifdef HAVE_MEMCG_EVENTS
/* Fires for every memcg event item on the node; only the two fault items go further. Runs in the faulting task's
 * context (mm_account_fault, filemap_fault, do_swap_page), whichever memcg the mm is charged to. */
int on_memcg_event(struct tracepoint__memcg__count_memcg_events *args)
{
    int item = args->item;
    if (item != PGFAULT_ITEM && item != PGMAJFAULT_ITEM)
        return 0;
    struct slot_stats *s = current_stats();
    if (!s)
        return 0;
    if (item == PGFAULT_ITEM)
        s->acct_faults += args->val;
    else
        s->major_faults += args->val;
    return 0;
}
#endif

/* ---- stalls: a begin in the stalled task, its end in the same task ------------------------------------------- */
static inline void stall_begin(u32 kind)
{
    int slot = job_slot_current();
    if (slot < 0)
        return;
    u64 key = ((u64)kind << 32) | (u32)bpf_get_current_pid_tgid();
    struct stall st = {.begin_ns = bpf_ktime_get_ns(), .slot = slot};
    if (stalls.update(&key, &st)) {    /* the table is full: this stall goes untimed — and is counted */
        u32 k = slot;
        struct slot_stats *s = stats.lookup(&k);
        if (s)
            s->untracked_stalls++;
    }
}

/* Returns the stall's ns and its slot's stats, or 0 when no begin was seen (attached mid-stall). User space
 * attaches every end before its begin, so a begin always meets its end and no entry is left behind. */
static inline struct slot_stats *stall_end(u32 kind, u64 *ns)
{
    u64 key = ((u64)kind << 32) | (u32)bpf_get_current_pid_tgid();
    struct stall *st = stalls.lookup(&key);
    if (!st)
        return 0;
    u64 now = bpf_ktime_get_ns();
    *ns = now > st->begin_ns ? now - st->begin_ns : 0;
    u32 slot = st->slot;
    stalls.delete(&key);
    return stats.lookup(&slot);
}

static inline void reclaim_end(struct slot_stats *s, u64 ns, unsigned long reclaimed)
{
    u32 b = log2_floor(ns / 1000);
    if (b >= NBUCKETS)
        b = NBUCKETS - 1;
    s->reclaim_hist[b]++;
    s->reclaimed_pages += reclaimed;
}

#ifdef HAVE_DIRECT_RECLAIM
int on_direct_begin(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_begin *args)
{
    stall_begin(STALL_DIRECT);
    return 0;
}

int on_direct_end(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_end *args)
{
    u64 ns = 0;
    struct slot_stats *s = stall_end(STALL_DIRECT, &ns);
    if (s) {
        s->direct_reclaim++;
        s->direct_reclaim_ns += ns;
        reclaim_end(s, ns, args->nr_reclaimed);
    }
    return 0;
}
#endif

#ifdef HAVE_MEMCG_RECLAIM
/* A charge over the cgroup's limit (v1 limit_in_bytes, v2 memory.max/high) reclaims in the charging task. */
int on_memcg_begin(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_begin *args)
{
    stall_begin(STALL_MEMCG);
    return 0;
}

int on_memcg_end(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_end *args)
{
    u64 ns = 0;
    struct slot_stats *s = stall_end(STALL_MEMCG, &ns);
    if (s) {
        s->memcg_reclaim++;
        s->memcg_reclaim_ns += ns;
        reclaim_end(s, ns, args->nr_reclaimed);
    }
    return 0;
}
#endif

#ifdef HAVE_COMPACTION
/* compact_zone(): direct compaction in an allocating task (once per zone tried), a write to
 * /proc/sys/vm/compact_memory, or kcompactd (a kernel thread, never a job member). */
int on_compact_begin(struct tracepoint__compaction__mm_compaction_begin *args)
{
    stall_begin(STALL_COMPACT);
    return 0;
}

int on_compact_end(struct tracepoint__compaction__mm_compaction_end *args)
{
    u64 ns = 0;
    struct slot_stats *s = stall_end(STALL_COMPACT, &ns);
    if (s) {
        s->compaction++;
        s->compaction_ns += ns;
    }
    return 0;
}
#endif

/* ---- OOM kills ---------------------------------------------------------------------------------------------- */
#ifdef HAVE_OOM
/* Runs in the task that invoked the OOM killer, not in the victim: the victim's pid is an argument. */
int on_mark_victim(struct tracepoint__oom__mark_victim *args)
{
    struct oom_rec rec = {};
    u32 pid = args->pid;
    rec.ts_ns = bpf_ktime_get_ns();
    rec.pid = pid;
    u32 *slot = job_of_tgid.lookup(&pid);
    rec.slot = slot && *slot < MAX_SLOTS ? (s32)*slot : SLOT_PENDING;
#ifdef OOM_HAS_RSS
    rec.total_vm_kb = args->total_vm;
    rec.anon_rss_kb = args->anon_rss;
    rec.file_rss_kb = args->file_rss;
    rec.shmem_rss_kb = args->shmem_rss;
#endif
#ifdef OOM_HAS_PGTABLES
    rec.pgtables_kb = args->pgtables;
#endif
#ifdef OOM_HAS_UID
    rec.uid = args->uid;
#endif
#ifdef OOM_HAS_SCORE_ADJ
    rec.oom_score_adj = args->oom_score_adj;
#endif
#ifdef OOM_HAS_COMM_LOC
    TP_DATA_LOC_READ_STR(rec.comm, comm, sizeof(rec.comm));
#elif defined(OOM_HAS_COMM)
    bpf_probe_read_kernel_str(rec.comm, sizeof(rec.comm), args->comm);
#endif
    oom_victims.update(&pid, &rec);
    return 0;
}
#endif
