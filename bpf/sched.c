/* sched.c — what the scheduler does to a job: context switches, off-CPU time and why, run-queue latency.
 *
 * Per job slot, summed in the kernel into one per-CPU struct (user space reads one map element per tick, there
 * is no per-event output):
 *   voluntary / involuntary switches of the job's threads (involuntary: still runnable when switched out),
 *   off-CPU ns: from a thread's switch-out to its next switch-in, split by why it left the CPU (sum == offcpu_ns):
 *     preempt  switched out runnable (prev_state R): the whole period is spent waiting for a CPU;
 *     io       uninterruptible sleep (prev_state D: disk I/O, reads through the page cache, kernel mutexes);
 *     lock     interruptible sleep inside a futex wait (locks, condition variables, semaphores, the GIL);
 *     sleep    interruptible sleep inside nanosleep / clock_nanosleep (timers);
 *     wait     every other sleep (poll/epoll/select, pipe and socket reads, wait4, stopped/traced);
 *     and for the four sleeps only their blocked part, to the wakeup; from the wakeup to running again is
 *     `wakeup` (waiting for a CPU after a sleep). Each reason also counts its finished periods.
 *   run-queue latency: from becoming runnable (wakeup, or preemption) to running, log2 µs histogram + sum.
 * Hooks: tracepoints sched:sched_switch (on_switch), sched:sched_wakeup (on_wakeup), sched:sched_wakeup_new
 *   (on_wakeup_new) — or, with -DRAW_SCHED (5.18+), the same as raw tracepoint programs (*_raw) —
 *   raw_syscalls:sys_enter (on_sys_enter, only with -DSYSCALL_HOOK; on_sys_enter_raw with -DRAW_SCHED too),
 *   attached by name from probes/sched.py;
 *   fork/exit from common.h.
 *   Only tracepoint arguments and helpers are read, never task_struct: kernel headers may not match the
 *   running kernel (this project's hosts run 6.18 with 6.12 headers), and kprobes may be absent.
 * Which syscall a sleeping thread is in (-DSYSCALL_REASONS), two ways:
 *   -DSYSCALL_FROM_REGS (5.15+ with BTF: bpf_get_current_task_btf, bpf_task_pt_regs): read at its switch-out from
 *   its saved user registers, where the syscall number stays while the call runs (x86_64 orig_ax, arm64
 *   syscallno; the futex op is the second argument), at offsets user space passes (the uapi struct pt_regs, not
 *   the kernel headers'). No syscall hook at all: nothing runs on the node's syscalls.
 *   -DSYSCALL_HOOK (older kernels): on_sys_enter remembers it, for member threads only and only for the
 *   classified calls (futex waits, nanosleeps): `in_call` tid -> reason, set on entering one, removed on entering any other
 *   syscall. No sys_exit hook: between a futex's return and the next syscall entry a thread can only sleep in a
 *   page fault (D, or S on userfaultfd), so the stale entry is harmless; one hook costs less than two (measured
 *   in a 6.18 VM, getppid loop: +37 ns per syscall with sys_enter alone, +57 ns with a sys_enter/sys_exit pair;
 *   program alone under bpf_stats ~50 ns vs ~37 + ~45 ns). Without -DSYSCALL_REASONS (option off, unknown
 *   syscall numbers, no raw_syscalls) lock and sleep are folded into wait and no syscall is hooked.
 * Oldest kernel: 4.18 (common.h); prev_state as "reported state" (bit per state, preempted → 0 in the low byte)
 *   since 4.14.
 * Cost (6.18 VM, bpf_stats): sched_switch runs on every switch of every task on the node: 1-2 lookups for prev's
 *   membership and one for next in `start`; members rewrite their `start` entry in place, and an interruptible
 *   sleep reads its syscall from its registers (or, with the hook, one lookup in `in_call`): a job ping-ponging
 *   over pipes, 174 ns per switch, 121 per wakeup (bcc's runqlat in the same run: 87 and 80). With the hook,
 *   sys_enter (every syscall of the node): a compare chain and one hash miss on the caller's tid, plus a
 *   membership check for futex waits and nanosleeps (getppid +15 ns raw, +43 ns classic; none without the hook).
 *   Memory: `start` (and `in_call`) hold one entry per job thread off CPU / in a classified call (deleted when it
 *   runs again or exits); maps are preallocated, ~5 MiB per hash of 64 Ki entries.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last: ≥ 2^26 µs */
#define MAX_OFFCPU_THREADS 65536

/* Reported prev_state bits (include/linux/sched.h TASK_REPORT, as the tracepoint's print fmt shows them). */
#define STATE_S 0x01           /* interruptible sleep */
#define STATE_D 0x02           /* uninterruptible sleep */
#define STATE_EXITING 0x30     /* X (dead) and Z (zombie): a task's last switch-out; it will never run again */

/* Why a thread left the CPU (off_rec.reason, in_call values). */
#define R_PREEMPT 1
#define R_IO 2
#define R_LOCK 3
#define R_SLEEP 4
#define R_WAIT 5

struct off_rec {
    u64 out_ns;   /* switch-out time; 0: never ran (a new task) */
    u64 enq_ns;   /* became runnable; 0: still asleep */
    u32 slot;
    u32 reason;   /* R_*; 0 for a new task */
    u32 tid;      /* the thread's id (0 until its first switch-out when RAW_SCHED made it at wakeup_new) */
    u32 pad;
};

/* Which thread a `start` entry is for. Classic tracepoints give thread ids; the raw ones (RAW_SCHED, Linux 5.18+:
 * sched_switch carries prev_state as an argument) give task_struct addresses, used as they are, never read. */
#ifdef RAW_SCHED
typedef u64 task_key;
#else
typedef u32 task_key;
#endif

struct slot_stats {
    u64 voluntary;
    u64 involuntary;
    u64 offcpu_ns;
    u64 runq_ns;
    u64 runq_events;
    u64 preempt_ns;
    u64 io_ns;
    u64 lock_ns;
    u64 sleep_ns;
    u64 wait_ns;
    u64 wakeup_ns;
    u64 preempt_events;
    u64 io_events;
    u64 lock_events;
    u64 sleep_events;
    u64 wait_events;
    u64 runq_hist[NBUCKETS];
};

BPF_HASH(start, task_key, struct off_rec, MAX_OFFCPU_THREADS);
BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */
#ifdef SYSCALL_HOOK
BPF_HASH(in_call, u32, u32, 65536);                /* tid -> R_LOCK / R_SLEEP; 65536 == MAX_MEMBER_TASKS */
#endif

/* A thread that exits while off CPU cannot happen (it runs do_exit), but a stale entry would stay forever; a
 * thread killed inside a futex wait leaves its in_call entry, removed here. */
#define JOB_ON_EXIT_HOOK
static inline void job_exit_hook(u32 tid)
{
#ifndef RAW_SCHED
    start.delete(&tid);     /* (raw: keyed by task address, deleted at the last switch-out below) */
#endif
#ifdef SYSCALL_HOOK
    in_call.delete(&tid);
#endif
}

#include "common.h"

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif


#ifdef SYSCALL_REASONS
/* The reason an interruptible sleep inside syscall `id` gets, or 0. NR_* come from user space (asm/unistd.h of
 * the running machine). Only futex ops that wait: a wake never sleeps, and skipping it saves the membership
 * check on every unlock of the node. */
static inline u32 syscall_reason(long id, unsigned long op)
{
    if (id == NR_FUTEX) {
        op &= 0x7f;            /* FUTEX_CMD_MASK: without FUTEX_PRIVATE_FLAG, FUTEX_CLOCK_REALTIME */
        /* WAIT, LOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2 (include/uapi/linux/futex.h) */
        return (op == 0 || op == 6 || op == 9 || op == 11 || op == 13) ? R_LOCK : 0;
    }
    if (id == NR_FUTEX_WAITV || id == NR_FUTEX_WAIT)
        return R_LOCK;
    if (id == NR_NANOSLEEP || id == NR_CLOCK_NANOSLEEP)
        return R_SLEEP;
    return 0;
}
#endif

#ifdef SYSCALL_FROM_REGS
/* The reason for the syscall the current thread is in, from its saved user registers: the number stays there
 * (orig_ax, syscallno; -1 outside a syscall) while the call runs. 32 bits at SYSCALL_NR_OFF: x86_64's orig_ax is
 * little-endian, arm64's syscallno an int. */
static inline u32 syscall_now(void)
{
    unsigned long regs = bpf_task_pt_regs(bpf_get_current_task_btf());
    s32 nr = -1;
    unsigned long op = 0;
    if (!regs || bpf_probe_read_kernel(&nr, sizeof(nr), (void *)(regs + SYSCALL_NR_OFF)))
        return 0;
    if (nr == NR_FUTEX)
        bpf_probe_read_kernel(&op, sizeof(op), (void *)(regs + SYSCALL_ARG2_OFF));
    return syscall_reason(nr, op);
}
#endif

/* Why `tid` (current, being switched out) leaves the CPU, from its reported state. */
static inline u32 offcpu_reason(long state, u32 tid)
{
    if (state == 0)
        return R_PREEMPT;
    if (state & STATE_D)
        return R_IO;
#if defined(SYSCALL_FROM_REGS)
    if (state & STATE_S) {
        u32 r = syscall_now();
        if (r)
            return r;
    }
#elif defined(SYSCALL_HOOK)
    if (state & STATE_S) {
        u32 *r = in_call.lookup(&tid);
        if (r)
            return *r;
    }
#endif
    return R_WAIT;
}

/* One finished off-CPU period of `reason`: `blocked` ns asleep (the whole period for a preemption). */
static inline void count_reason(struct slot_stats *s, u32 reason, u64 blocked)
{
    if (reason == R_PREEMPT) {
        s->preempt_ns += blocked;
        s->preempt_events++;
    } else if (reason == R_IO) {
        s->io_ns += blocked;
        s->io_events++;
    } else if (reason == R_LOCK) {
        s->lock_ns += blocked;
        s->lock_events++;
    } else if (reason == R_SLEEP) {
        s->sleep_ns += blocked;
        s->sleep_events++;
    } else {
        s->wait_ns += blocked;
        s->wait_events++;
    }
}

/* One context switch: prev (current; `prev` its key, `prev_tid` its thread id, 0 for an idle task) leaves the CPU
 * in reported state `state`, next (key `next`, 0 for an idle task) gets it. */
static inline int switched(task_key prev, u32 prev_tid, long state, task_key next)
{
    u64 now = bpf_ktime_get_ns();

    /* The tracepoint runs before the switch: "current" is still prev, so membership helpers see prev. */
    if (prev_tid != 0) {
        int slot = job_slot_current();
        if (slot >= 0) {
            u32 key = slot;
            struct slot_stats *s = stats.lookup(&key);
            if (s) {
                if (state == 0)
                    s->involuntary++;
                else
                    s->voluntary++;
            }
            if (!(state & STATE_EXITING)) {
                /* Preempted: runnable from this instant, so this is also its run-queue entry time. */
                struct off_rec rec = {.out_ns = now, .enq_ns = state == 0 ? now : 0, .slot = slot,
                                      .reason = offcpu_reason(state, prev_tid), .tid = prev_tid};
                /* A thread's entry stays from its first switch-out to its end: rewritten in place, it costs a
                 * lookup instead of a hash insert and delete per switch. */
                struct off_rec *old = start.lookup(&prev);
                if (old)
                    *old = rec;
                else
                    start.update(&prev, &rec);
            }
        }
        if (state & STATE_EXITING) {
            /* Its last switch-out, member or not by now: job_exit may have dropped its process from the
             * membership maps, and a preemption late in do_exit can have written an entry after job_exit_hook
             * ran. Deleting here, for every task that dies on the node, leaves no entry behind. */
            start.delete(&prev);
#ifdef SYSCALL_HOOK
            in_call.delete(&prev_tid);
#endif
        }
    }

    if (next == 0)
        return 0;
    struct off_rec *rec = start.lookup(&next);
    if (!rec || (rec->out_ns == 0 && rec->enq_ns == 0))
        return 0;   /* not a member, or running already (its period was consumed) */
    u32 key = rec->slot;
    struct slot_stats *s = stats.lookup(&key);
    if (s) {
        if (rec->out_ns) {
            /* Counted even if the clock read here is not past out_ns (vCPUs' clocks may differ by a hair). */
            u64 off = now > rec->out_ns ? now - rec->out_ns : 0, blocked = off;
            /* A sleep ends at its wakeup (on_wakeup sets enq_ns, always after the switch-out: the waker
             * needs prev off its CPU or its rq lock); the rest is the wait for a CPU. */
            if (rec->reason != R_PREEMPT && rec->enq_ns >= rec->out_ns && rec->enq_ns <= now) {
                blocked = rec->enq_ns - rec->out_ns;
                s->wakeup_ns += now - rec->enq_ns;
            }
            s->offcpu_ns += off;
            count_reason(s, rec->reason, blocked);
        }
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
    rec->out_ns = 0;   /* consumed: kept for the next switch-out, deleted when the thread exits */
    rec->enq_ns = 0;
    return 0;
}

/* Fired when a sleeping (or not yet switched-in) task is put on a run queue. Only threads we saw leave the CPU
 * have an entry, so no membership check is needed here. The first wakeup wins: a task woken while already
 * runnable (preempted, or woken twice) has been waiting since the earlier time. */
static inline void woken(task_key task)
{
    struct off_rec *rec = start.lookup(&task);
    if (rec && rec->out_ns && rec->enq_ns == 0)   /* off CPU (not a consumed entry of a running thread) */
        rec->enq_ns = bpf_ktime_get_ns();
}

/* A new task has never been switched out; it joins its creator's job (current is the parent in
 * wake_up_new_task), and its first wait for a CPU counts as run-queue latency. */
static inline void woken_new(task_key task, u32 tid)
{
    int slot = job_slot_current();
    if (slot < 0)
        return;
    struct off_rec rec = {.out_ns = 0, .enq_ns = bpf_ktime_get_ns(), .slot = slot, .tid = tid};
    start.update(&task, &rec);
}

#ifndef RAW_SCHED
int on_switch(struct tracepoint__sched__sched_switch *args)
{
    return switched(args->prev_pid, args->prev_pid, args->prev_state & 0xff, args->next_pid);
}

int on_wakeup(struct tracepoint__sched__sched_wakeup *args)
{
    woken(args->pid);
    return 0;
}

int on_wakeup_new(struct tracepoint__sched__sched_wakeup_new *args)
{
    woken_new(args->pid, args->pid);
    return 0;
}

#else
/* Raw tracepoint programs: no format record is built for them (the classic one copies two comms and more on
 * every switch of the node), a BPF program here does not hide the event from perf users, and the kernel only
 * skips one when it would re-enter itself. Arguments: sched_switch (bool preempt, struct task_struct *prev,
 * struct task_struct *next, unsigned int prev_state) (5.18+), sched_wakeup[_new] (struct task_struct *p).
 *
 * prev_state here is the task's raw __state; the classic tracepoint reports it as one bit of TASK_REPORT, which
 * is what offcpu_reason reads: preemption (or still TASK_RUNNING) as 0; TASK_IDLE as I (0x80); an rt-lock wait
 * as D; a dying task (TASK_DEAD; reported from exit_state as Z or X) as exiting; else the highest of the
 * S D T t X Z P bits. Values from include/linux/sched.h, unchanged since 5.15. */
#define RAW_TASK_REPORT 0x7f
#define RAW_TASK_DEAD 0x80
#define RAW_TASK_IDLE 0x402            /* TASK_UNINTERRUPTIBLE | TASK_NOLOAD */
#define RAW_TASK_RTLOCK_WAIT 0x1000
#define REPORTED_IDLE 0x80
#define REPORTED_DEAD 0x10

static inline long reported_state(u64 preempt, u32 st)
{
    if (preempt)
        return 0;
    if (st & RAW_TASK_DEAD)
        return REPORTED_DEAD;
    if (st == RAW_TASK_IDLE)
        return REPORTED_IDLE;
    if (st & RAW_TASK_RTLOCK_WAIT)
        return STATE_D;
    st &= RAW_TASK_REPORT;
    return st ? 1 << log2_floor(st) : 0;
}

int on_switch_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u32 prev_tid = bpf_get_current_pid_tgid();   /* current is prev; 0 for an idle task */
    return switched(ctx->args[1], prev_tid, reported_state(ctx->args[0], (u32)ctx->args[3]), ctx->args[2]);
}

int on_wakeup_raw(struct bpf_raw_tracepoint_args *ctx)
{
    woken(ctx->args[0]);
    return 0;
}

int on_wakeup_new_raw(struct bpf_raw_tracepoint_args *ctx)
{
    woken_new(ctx->args[0], 0);
    return 0;
}
#endif

#ifdef SYSCALL_HOOK
/* Every syscall of the node passes here: the common case (not a classified call, no entry) is one compare chain
 * and one hash miss. */
static inline int sys_entered(long id, unsigned long op)
{
    u32 tid = bpf_get_current_pid_tgid();
    u32 reason = syscall_reason(id, op);
    if (!reason) {
        if (in_call.lookup(&tid))
            in_call.delete(&tid);
        return 0;
    }
    if (job_slot_current() < 0)
        return 0;
    in_call.update(&tid, &reason);
    return 0;
}

#ifndef RAW_SCHED
int on_sys_enter(struct tracepoint__raw_syscalls__sys_enter *args)
{
    return sys_entered(args->id, args->args[1]);
}
#else
/* Raw: (struct pt_regs *regs, long id). A futex's op, its second argument, is read from the caller's saved
 * registers at SYSCALL_ARG2_OFF (user space passes it per architecture: offsetof(struct pt_regs, si) on x86_64,
 * regs[1] on arm64; the uapi layout, not the kernel headers'). Only for futex: every other call needs the id. */
int on_sys_enter_raw(struct bpf_raw_tracepoint_args *ctx)
{
    long id = ctx->args[1];
    unsigned long op = 0;
    if (id == NR_FUTEX)
        bpf_probe_read_kernel(&op, sizeof(op), (void *)(ctx->args[0] + SYSCALL_ARG2_OFF));
    return sys_entered(id, op);
}
#endif
#endif
