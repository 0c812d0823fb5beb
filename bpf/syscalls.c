// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* syscalls.c — where a job's threads spend their time in system calls: calls and time per syscall and per class.
 *
 * Per job slot, summed in the kernel (no per-event output):
 *   stats   per-CPU array, one struct per slot: calls, ns and a log2 µs latency histogram per class (the class of
 *           a syscall number comes from class_of, filled by user space from the syscall names), plus `untracked`:
 *           calls that found no room in by_nr;
 *   by_nr   per-CPU hash (slot << 16 | nr) -> {calls, ns}: the per-syscall totals behind the "top" list.
 *   A call is counted when it returns, with its full duration (a 10 s poll lands in the interval where it ends);
 *   calls that never return (exit, exit_group, a thread killed inside a syscall) are not counted.
 * Hooks: tracepoints raw_syscalls:sys_enter (on_enter), raw_syscalls:sys_exit (on_exit) — raw tracepoint
 *   programs on_enter_raw / on_exit_raw with -DRAW_SYSCALLS — and
 *   sched:sched_process_exec through common.h's job_exec (JOB_ON_EXEC_HOOK: a non-leader thread's execve
 *   changes its tid), attached by name from probes/syscalls.py; fork/exit/exec from common.h. Only tracepoint arguments and helpers are read.
 * Oldest kernel: 4.18 (common.h). by_nr keys are never deleted, so an insert never reuses an element that holds
 *   other CPUs' old values (kernels before 5.10 did not zero them).
 * Cost: both programs run on every syscall of every task on the node, so the non-member path is the one that
 *   matters: enter does one inlined array read (job_kinds) and one hash lookup (job_of_cgroup for a cgroup job,
 *   job_of_tgid for a PID tree, both only when both kinds are watched); exit does one hash lookup (inflight, by
 *   tid). A member's call adds an in-place write at enter and, at exit, one per-CPU array and one per-CPU hash
 *   lookup. Measured (6.18 VM, bpf_stats): ~100-130 ns per non-member syscall for both programs, ~210-270 ns per
 *   member's; details in probes/syscalls.py. Memory: stats is 1.8 KiB per slot per possible CPU (116 KiB per
 *   CPU); by_nr 4096 keys x 16 B per CPU; inflight one 16 B entry per live member thread.
 * Classic programs return 0, which also stops the event for perf users of the same tracepoint on the whole node
 *   (perf_trace_run_bpf_submit); returning 1 would instead cost ~230 ns a syscall on the CPU that holds the
 *   attachment's perf event. Raw tracepoint programs (-DRAW_SYSCALLS, 4.17+, the *_raw functions) avoid both.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last: ≥ 2^26 µs */
#define NCLASSES 8             /* probes/syscalls.py CLASSES; class 0 is "other", the default of class_of */
#define NR_MAX 1024            /* numbers at or above it (x32's bit 30, -1) are all counted as NR_MAX */
#define MAX_NR_KEYS 4096       /* (slot, nr) pairs: 64 syscalls per slot on average, far more than jobs use */
#ifndef MAX_INFLIGHT
#define MAX_INFLIGHT 65536      /* member threads, node-wide (a test makes it smaller) */
#endif


struct inflight_rec {
    u64 ts;                    /* sys_enter time; 0: not inside a syscall we are timing */
    u32 slot;
    u32 nr;
};

struct nr_total {
    u64 calls;
    u64 ns;
};

struct slot_stats {
    u64 calls[NCLASSES];
    u64 ns[NCLASSES];
    u64 untracked;
    u64 unrecorded;            /* calls entered while `inflight` was full: not timed, in no count above */
    u64 hist[NCLASSES][NBUCKETS];
};

/* Entries live as long as their thread: written in place at each enter, zeroed at exit, deleted when the thread
 * ends (job_exit_hook) — so a member's call costs a lookup, not a hash insert and delete. */
BPF_HASH(inflight, u32, struct inflight_rec, MAX_INFLIGHT);
BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */
BPF_PERCPU_HASH(by_nr, u32, struct nr_total, MAX_NR_KEYS);
BPF_ARRAY(class_of, u32, NR_MAX + 1);

/* A thread killed inside a syscall (exit_group from another thread, a fatal signal) never reaches sys_exit. */
#define JOB_ON_EXIT_HOOK
static inline void job_exit_hook(u32 tid)
{
    inflight.delete(&tid);
}

/* A non-leader thread that execs takes the process's pid: its in-flight execve moves to the new tid. */
#define JOB_ON_EXEC_HOOK
static inline void job_exec_hook(u32 old, u32 now)
{
    struct inflight_rec *rec = inflight.lookup(&old);
    if (!rec)
        return;
    struct inflight_rec moved = *rec;
    inflight.update(&now, &moved);
    inflight.delete(&old);
}

#include "common.h"

#ifdef JOB_DEEP_TRACE
/* Deep-trace windows: each syscall of a traced job's thread that took at least job_trace_min_ns(). */
#define TRACE_SYSCALL 2
struct syscall_event {
    struct trace_head h;
    u32 tid;
    u32 tgid;
    u64 enter_ns;
    u64 exit_ns;
    u32 nr;
    u32 pad;
};
#endif

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif


/* The job's slot of the calling thread: common.h's job_slot_current(), which asks only the membership maps in use
 * on the node (job_kinds: one hash lookup for a non-member on a node that watches only PID trees). */
static inline int syscall_slot(void)
{
    return job_slot_current();
}

static inline int entered(long id)
{
    int slot = syscall_slot();
    if (slot < 0)
        return 0;
    u32 tid = bpf_get_current_pid_tgid();
    u32 nr = id >= 0 && id < NR_MAX ? (u32)id : NR_MAX;
    u64 now = bpf_ktime_get_ns();
    struct inflight_rec *rec = inflight.lookup(&tid);
    if (rec) {
        rec->ts = now;
        rec->slot = slot;
        rec->nr = nr;
        return 0;
    }
    struct inflight_rec fresh = {.ts = now, .slot = slot, .nr = nr};
    if (inflight.update(&tid, &fresh)) {     /* the table is full: this call goes unrecorded — and is counted */
        u32 key = slot;
        struct slot_stats *s = stats.lookup(&key);
        if (s)
            s->unrecorded++;
    }
    return 0;
}

static inline int exited(void)
{
    u32 tid = bpf_get_current_pid_tgid();
    struct inflight_rec *rec = inflight.lookup(&tid);
    if (!rec || rec->ts == 0)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 d = now > rec->ts ? now - rec->ts : 0;
    u32 slot = rec->slot, nr = rec->nr;
#ifdef JOB_DEEP_TRACE
    if (d >= job_trace_min_ns() && job_traced(slot)) {
        u64 id = bpf_get_current_pid_tgid();
        struct syscall_event ev = {.h = {.kind = TRACE_SYSCALL, .slot = slot}, .tid = (u32)id, .tgid = id >> 32,
                                   .enter_ns = rec->ts, .exit_ns = now, .nr = nr};
        job_trace_output(ev.h.slot, &ev, sizeof(ev));
    }
#endif
    rec->ts = 0;

    u32 cls = 0, *c = class_of.lookup(&nr);
    if (c && *c < NCLASSES)
        cls = *c;
    u32 b = log2_floor(d / 1000);
    if (b >= NBUCKETS)
        b = NBUCKETS - 1;
    struct slot_stats *s = stats.lookup(&slot);
    if (!s)
        return 0;
    s->calls[cls]++;
    s->ns[cls] += d;
    s->hist[cls][b]++;

    /* Per-CPU: no other CPU writes this CPU's value, so plain adds suffice. Insert with NOEXIST: two CPUs adding
     * the same new key at once must not replace each other's element (BPF_ANY would drop the first count). */
    u32 key = slot << 16 | nr;
    struct nr_total *t = by_nr.lookup(&key);
    if (!t) {
        struct nr_total fresh = {.calls = 1, .ns = d};
        if (by_nr.insert(&key, &fresh) == 0)
            return 0;
        t = by_nr.lookup(&key);
        if (!t) {
            s->untracked++;   /* the map is full: counted in its class, missing from the top list */
            return 0;
        }
    }
    t->calls++;
    t->ns += d;
    return 0;
}

#ifndef RAW_SYSCALLS
int on_enter(struct tracepoint__raw_syscalls__sys_enter *args)
{
    return entered(args->id);
}

int on_exit(struct tracepoint__raw_syscalls__sys_exit *args)
{
    return exited();
}
#else
/* RAW_SYSCALLS (4.17+): raw tracepoint programs. sys_enter's C arguments are (struct pt_regs *regs, long id) and
 * sys_exit's (struct pt_regs *regs, long ret): the number is an argument, and the return needs nothing. No event
 * record is built for them, perf users of raw_syscalls keep their counts, and the kernel skips one only when it
 * would re-enter itself. */
int on_enter_raw(struct bpf_raw_tracepoint_args *ctx)
{
    return entered((long)ctx->args[1]);
}

int on_exit_raw(struct bpf_raw_tracepoint_args *ctx)
{
    return exited();
}
#endif

/* execve from a thread other than the leader: the thread takes the leader's pid (de_thread) and its old tid ends
 * without a sched_process_exit of its own. Move its entry to the new tid, so that the execve's return is timed
 * and the old key does not stay behind. Runs in the exec'ing task, after the switch of ids. */

