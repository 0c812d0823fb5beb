/* sched.c — what the scheduler does to a job: context switches, off-CPU time, run-queue latency.
 *
 * Per job slot, summed in the kernel into one per-CPU struct (user space reads one map element per tick, there
 * is no per-event output):
 *   voluntary / involuntary switches of the job's threads (involuntary: still runnable when switched out),
 *   off-CPU ns: from a thread's switch-out to its next switch-in,
 *   run-queue latency: from becoming runnable (wakeup, or preemption) to running, log2 µs histogram + sum.
 * Hooks: tracepoints sched:sched_switch (on_switch), sched:sched_wakeup (on_wakeup), sched:sched_wakeup_new
 *   (on_wakeup_new), attached by name from probes/sched.py; fork/exit from common.h.
 *   Only tracepoint arguments and helpers are read, never task_struct: kernel headers may not match the
 *   running kernel (this project's hosts run 6.18 with 6.12 headers), and kprobes may be absent.
 * Oldest kernel: 4.18 (common.h); prev_state as "reported state" (bit per state, preempted → 0 in the low byte)
 *   since 4.14.
 * Cost: sched_switch runs on every switch of every task on the node: 1-2 lookups for prev's membership and one
 *   for next in `start`; members add one update/delete (~150 ns per switch measured in a 6.18 VM). sched_wakeup:
 *   one lookup (~70 ns). Memory: `start` holds one entry per job thread that is off CPU (deleted when it runs
 *   again or exits); maps are preallocated, ~5 MiB per hash of 64 Ki entries.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last: ≥ 2^26 µs */
#define MAX_OFFCPU_THREADS 65536

/* Reported prev_state bits: X (dead) and Z (zombie) mark a task's last switch-out; it will never run again. */
#define STATE_EXITING 0x30

struct off_rec {
    u64 out_ns;   /* switch-out time; 0: never ran (a new task) */
    u64 enq_ns;   /* became runnable; 0: still asleep */
    u32 slot;
};

struct slot_stats {
    u64 voluntary;
    u64 involuntary;
    u64 offcpu_ns;
    u64 runq_ns;
    u64 runq_events;
    u64 runq_hist[NBUCKETS];
};

BPF_HASH(start, u32, struct off_rec, MAX_OFFCPU_THREADS);
BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */

/* A thread that exits while off CPU cannot happen (it runs do_exit), but a stale entry would stay forever. */
#define JOB_ON_EXIT_HOOK
static inline void job_exit_hook(u32 tid)
{
    start.delete(&tid);
}

#include "common.h"

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif

static inline u32 log2_floor(u64 v)
{
    u32 r = 0;
    if (v >> 32) { v >>= 32; r += 32; }
    if (v >> 16) { v >>= 16; r += 16; }
    if (v >> 8)  { v >>= 8;  r += 8; }
    if (v >> 4)  { v >>= 4;  r += 4; }
    if (v >> 2)  { v >>= 2;  r += 2; }
    if (v >> 1)  { r += 1; }
    return r;
}

int on_switch(struct tracepoint__sched__sched_switch *args)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid, next = args->next_pid;

    /* The tracepoint runs before the switch: "current" is still prev, so membership helpers see prev. */
    if (prev != 0) {
        int slot = job_slot_current();
        if (slot >= 0) {
            u32 key = slot;
            struct slot_stats *s = stats.lookup(&key);
            long state = args->prev_state & 0xff;
            if (s) {
                if (state == 0)
                    s->involuntary++;
                else
                    s->voluntary++;
            }
            if (!(state & STATE_EXITING)) {
                /* Preempted: runnable from this instant, so this is also its run-queue entry time. */
                struct off_rec rec = {.out_ns = now, .enq_ns = state == 0 ? now : 0, .slot = slot};
                start.update(&prev, &rec);
            }
        }
    }

    if (next == 0)
        return 0;
    struct off_rec *rec = start.lookup(&next);
    if (!rec)
        return 0;
    u32 key = rec->slot;
    struct slot_stats *s = stats.lookup(&key);
    if (s) {
        if (rec->out_ns && now > rec->out_ns)
            s->offcpu_ns += now - rec->out_ns;
        if (rec->enq_ns && now >= rec->enq_ns) {
            u64 delta = now - rec->enq_ns;
            u32 b = log2_floor(delta / 1000);
            if (b >= NBUCKETS)
                b = NBUCKETS - 1;
            s->runq_ns += delta;
            s->runq_events++;
            s->runq_hist[b]++;
        }
    }
    start.delete(&next);
    return 0;
}

/* Fired when a sleeping (or not yet switched-in) task is put on a run queue. Only threads we saw leave the CPU
 * have an entry, so no membership check is needed here. The first wakeup wins: a task woken while already
 * runnable (preempted, or woken twice) has been waiting since the earlier time. */
int on_wakeup(struct tracepoint__sched__sched_wakeup *args)
{
    u32 tid = args->pid;
    struct off_rec *rec = start.lookup(&tid);
    if (rec && rec->enq_ns == 0)
        rec->enq_ns = bpf_ktime_get_ns();
    return 0;
}

/* A new task has never been switched out; it joins its creator's job (current is the parent in
 * wake_up_new_task), and its first wait for a CPU counts as run-queue latency. */
int on_wakeup_new(struct tracepoint__sched__sched_wakeup_new *args)
{
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    u32 tid = args->pid;
    struct off_rec rec = {.out_ns = 0, .enq_ns = bpf_ktime_get_ns(), .slot = slot};
    start.update(&tid, &rec);
    return 0;
}
