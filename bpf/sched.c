// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
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
 *     wait     every other sleep (poll/epoll/select, pipe and socket reads, wait4);
 *     stopped  stopped or traced (prev_state T, t: SIGSTOP, a debugger): paused, not waiting for anything;
 *     and for the five sleeps only their blocked part, to the wakeup; from the wakeup to running again is
 *     `wakeup` (waiting for a CPU after a sleep). Each reason also counts its finished periods.
 *   run-queue latency: from becoming runnable (wakeup, or preemption) to running, log2 µs histogram + sum.
 * Times are kept so that user space can tell the time spent off CPU *within* an interval, also of threads still
 *   off CPU at the tick: per time category (T_RUNQ, R_*, T_WAKEUP), `done_ns` holds the finished parts, and
 *   `open_n` / `open_ns` the number of periods open now and the sum of their start times. At time t the category
 *   holds done_ns + open_n * t - open_ns (every open period counted up to t), summed over CPUs modulo 2^64 (a
 *   period opened on one CPU may close on another: one CPU's open_n goes up, another's down). A sleep's blocked
 *   part closes at its wakeup, where its `wakeup` part opens. The interval's value is the difference of that sum
 *   between two ticks; a period's parts always sum to its whole (switch-out to switch-in). Every write of
 *   these arrays is bracketed by a per-CPU seqcount (seq_begun, the struct's last word, before; seq_done, its
 *   first, after: write_begin): user space takes a copy again while a CPU's two differ, and a slot still torn is
 *   not read that tick (the interval reads 0, counted as `torn_reads` by probes/sched.py; the next one has it).
 *   What can read short: such a held interval, and a period whose switch-in or wakeup the kernel skipped
 *   (bpf_missed).
 * Hooks: tracepoints sched:sched_switch (on_switch), sched:sched_wakeup (on_wakeup), sched:sched_wakeup_new
 *   (on_wakeup_new) — or, with -DRAW_SCHED (5.18+), the same as raw tracepoint programs (*_raw), or with
 *   -DBTF_SCHED too (the kernel's BTF) as BTF tracepoint programs (*_btf, tp_btf) whose records are task storage —
 *   raw_syscalls:sys_enter (on_sys_enter, only with -DSYSCALL_HOOK; on_sys_enter_raw with -DRAW_SCHED too),
 *   attached by name from probes/sched.py;
 *   fork/exit from common.h.
 *   task_struct is never read at header offsets: kernel headers may not match the running kernel (this project's
 *   hosts run 6.18 with 6.12 headers), and kprobes may be absent. The BTF programs read two members (pid, cgroups)
 *   at offsets user space takes from the running kernel's BTF, which the verifier checks; the others read
 *   tracepoint arguments and helpers only.
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
 * Cost (6.18 VM, bpf_stats): sched_switch runs on every switch of every task on the node: prev's membership (BTF:
 *   the answer kept in its record while the membership generation and its css_set are unchanged; else this CPU's
 *   last answer when prev is of the same group and process as the last task asked, else 1-2 lookups:
 *   job_slot_cached in common.h) and one lookup for next's record (task storage with BTF, else `start`; none for
 *   the CPU's idle task); members rewrite their record in place, and an interruptible sleep reads its syscall
 *   from its registers (or, with the hook, one lookup in `in_call`); the clock is read only for a record's
 *   switch-in (bpf_ktime_get_ns, ~75 ns here, is the dearest step; runqlat reads it there too): BTF programs stamp a
 *   member's switch-out and wakeup with its run queue's clock (stamp_ns), the others read the clock there too.
 *   A job ping-ponging over pipes (`jobprobe bench agent --jobs 1,16,64 --n 30000`): on_switch_btf 210-236 ns per
 *   switch, 0.92-0.97x runqlat's in the same runs, on_wakeup_btf 0.94-1.12x; before the stamps 275-307 ns per
 *   switch, on_wakeup_btf 173-190 (runqlat in the same runs: 236-252 and 159-170);
 *   raw programs with the hash: 299-301 ns (runqlat 206-207). With the hook, sys_enter (every syscall of the node): a compare
 *   chain and one hash miss on the caller's tid, plus a membership check for futex waits and nanosleeps (getppid
 *   +15 ns raw, +43 ns classic; none without the hook).
 *   Memory: `start` (and `in_call`) hold one entry per job thread off CPU / in a classified call (deleted when it
 *   runs again or exits); maps are preallocated, ~5 MiB per hash of 64 Ki entries; task storage is allocated per
 *   member thread at its first switch-out (or its wakeup_new, where the allocation makes that run µs long) and
 *   freed with the thread.
 */
#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last: ≥ 2^26 µs */
#define MAX_OFFCPU_THREADS 65536

/* Reported prev_state bits (include/linux/sched.h TASK_REPORT, as the tracepoint's print fmt shows them). */
#define STATE_S 0x01           /* interruptible sleep */
#define STATE_D 0x02           /* uninterruptible sleep */
#define STATE_T 0x04           /* stopped (SIGSTOP, SIGTSTP; a job-control stop) */
#define STATE_TRACED 0x08      /* stopped by a tracer */
#define STATE_EXITING 0x30     /* X (dead) and Z (zombie): a task's last switch-out; it will never run again */
/* Preempted on its way to sleep (raw and BTF programs: preempt set, its raw state not TASK_RUNNING): involuntary,
 * off CPU as preempted, but not waiting on a run queue — it is picked again only to finish going to sleep, and
 * the kernel's run_delay (sched_info_depart: task_is_running) and runqlat leave that time out too. A busy job's
 * threads, preempted between prepare_to_wait and schedule(), waited there up to a time slice each (+0.5..4.5 µs
 * per run-queue wait over the kernel's figure; a burner's neighbour, 4 ms in each 4 ms interval). The classic
 * tracepoint reports every preemption as R+ and cannot tell. */
#define STATE_PREEMPTED_ASLEEP 0x10000

/* Why a thread left the CPU (off_rec.reason, in_call values). */
#define R_PREEMPT 1
#define R_IO 2
#define R_LOCK 3
#define R_SLEEP 4
#define R_WAIT 5
#define R_STOPPED 7            /* after T_WAKEUP (6): the time categories' last index */

struct off_rec {
    u64 out_ns;   /* switch-out time; 0: never ran (a new task) */
    u64 enq_ns;   /* became runnable; 0: still asleep */
    u32 slot;
    u32 reason;   /* R_*; 0 for a new task */
    u32 tid;      /* the thread's id (0 until its first switch-out when RAW_SCHED made it at wakeup_new) */
    u32 tgid;     /* set only for a period of a job in a deep-trace window (JOB_DEEP_TRACE): record it */
    s32 kstack;   /* deep trace: bytes of its stacks at switch-out in trace_stacks (negative: -errno, -1 none) */
    s32 ustack;
    u32 epoch;    /* BTF_SCHED: its slot's epoch when made (slot_epoch); a record of an earlier job counts nowhere */
    s32 mslot;    /* BTF_SCHED: the thread's membership slot (-1: none), kept for membership generation mgen */
    u32 mgen;
    u32 pad;
    u64 css;      /* BTF_SCHED: ... and while the thread stays in the cgroups it was in (task_struct.cgroups) */
};

/* Which thread a `start` entry is for. Classic tracepoints give thread ids; the raw ones (RAW_SCHED, Linux 5.18+:
 * sched_switch carries prev_state as an argument) give task_struct addresses, used as they are, never read. */
#if defined(BTF_SCHED)
struct task_struct;
typedef struct task_struct *task_key;
#elif defined(RAW_SCHED)
typedef u64 task_key;
#else
typedef u32 task_key;
#endif

/* Time categories: the index into done_ns / open_n / open_ns (R_* 1..5 and 7 are the reasons, events[] uses them
 * too). */
#define T_RUNQ 0               /* runnable, waiting for a CPU: a preemption, a woken sleeper, a new task */
#define T_WAKEUP 6             /* of an off-CPU period that was a sleep, from its wakeup to running again */
#define NTIMES 8               /* all used; a power of two so that an index can be masked for the verifier */

struct slot_stats {
    u64 seq_done;              /* writes of the time arrays finished: the FIRST member (see write_begin) */
    u64 voluntary;
    u64 involuntary;
    u64 runq_events;
    u64 switch_ins_missed;     /* periods whose switch-in the program never saw, closed at a later switch-out */
    u64 switch_in_missed_ns;   /* ... the time they were counted open after the thread was back on a CPU */
    u64 events[NTIMES];        /* finished off-CPU periods by reason (index R_*) */
    u64 done_ns[NTIMES];       /* finished time by category */
    u64 open_n[NTIMES];        /* periods open now (this CPU's share: opened here minus closed here) */
    u64 open_ns[NTIMES];       /* the sum of their start times (same share) */
    u64 runq_hist[NBUCKETS];
    u64 seq_begun;             /* writes begun: the LAST member */
};

BPF_PERCPU_ARRAY(stats, struct slot_stats, 64);   /* 64 == MAX_SLOTS, checked below */
#ifdef BTF_SCHED
/* The record lives in the task (task local storage, 5.11+, here with BTF tracepoint programs): found from the
 * task pointer with no hashing (6.18 VM, bpf_stats: two lookups 33 ns against 72 for the hash), gone with the
 * task. User space cannot walk it, so a released slot is not cleaned record by record: its epoch moves instead
 * (slot_epoch, user space), and a record made under another epoch closes into nothing. */
BPF_TASK_STORAGE(start, struct off_rec);
BPF_ARRAY(slot_epoch, u32, 64);

static inline u32 epoch_of(u32 slot)
{
    u32 *e = slot_epoch.lookup(&slot);
    return e ? *e : 0;
}

static inline struct off_rec *rec_get(task_key task)
{
    return start.task_storage_get(task, 0, 0);
}

/* `rec` as the task's record; nonzero when none can be made. */
static inline int rec_put(task_key task, struct off_rec *rec)
{
    struct off_rec *p = start.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (!p)
        return -1;
    *p = *rec;
    return 0;
}

static inline void rec_del(task_key task)
{
    start.task_storage_delete(task);
}
#else
BPF_HASH(start, task_key, struct off_rec, MAX_OFFCPU_THREADS);

static inline u32 epoch_of(u32 slot)
{
    return 0;               /* release() deletes a slot's records */
}

static inline struct off_rec *rec_get(task_key task)
{
    return start.lookup(&task);
}

static inline int rec_put(task_key task, struct off_rec *rec)
{
    return start.update(&task, rec);
}

static inline void rec_del(task_key task)
{
    start.delete(&task);
}
#endif
#ifdef SYSCALL_HOOK
BPF_HASH(in_call, u32, u32, 65536);                /* tid -> R_LOCK / R_SLEEP; 65536 == MAX_MEMBER_TASKS */
#endif

/* A thread that exits while off CPU cannot happen (it runs do_exit), but a stale entry would stay forever; a
 * thread killed inside a futex wait leaves its in_call entry, removed here. */
#define JOB_ON_EXIT_HOOK
static inline void forget(task_key task, u64 now);
static inline void job_exit_hook(u32 tid)
{
#ifndef RAW_SCHED
    forget(tid, 0);   /* (raw: keyed by task address, forgotten at the last switch-out below) */
#endif
#ifdef SYSCALL_HOOK
    in_call.delete(&tid);
#endif
}

#define JOB_SLOT_CACHE         /* membership of the task leaving a CPU: this CPU's last answer (common.h) */
#ifndef JOB_TRACE_PAGES
#define JOB_TRACE_PAGES 1024   /* 4 MiB: a deep trace's records carry their stacks (~0.5 KiB each) */
#endif
#include "common.h"

#if defined(RAW_SCHED) && !defined(BTF_SCHED)
/* This CPU's idle task (raw: switches name tasks by address): a switch to it needs no lookup of its record. */
BPF_PERCPU_ARRAY(idle_task, u64, 1);
#endif

#ifdef JOB_DEEP_TRACE
/* Deep-trace windows: each off-CPU period of a traced job's thread at least job_trace_min_ns() long, with the
 * kernel and user stacks it left the CPU with (48 frames each, innermost first). Each record carries its own
 * stacks: a stack map (bpf_get_stackid) keeps the first stack that hashes to a bucket and refuses every other one
 * for as long as it holds it, and the stacks of periods too short to record (a busy loop's preemptions) are named
 * by no record, so a window could lose every later sleep's stack to one of them (370 of 582 once, in CI).
 * At switch-out the stacks are read (bpf_get_stack) into the thread's entry of trace_stacks; at switch-in a period
 * long enough to record is written with them: its fixed part, then the kernel stack's bytes, then the user
 * stack's (ustack, kstack: their lengths in bytes, or -errno where none could be read; -12: trace_stacks full). */
#define TRACE_OFFCPU 1
#define TRACE_DEPTH 48
#ifndef TRACE_STACK_THREADS
#define TRACE_STACK_THREADS 4096   /* threads of traced jobs with stacks held (768 bytes each); user space empties
                                      it once no window is open */
#endif
struct deep_stacks {
    u64 k[TRACE_DEPTH];
    u64 u[TRACE_DEPTH];
};
BPF_HASH(trace_stacks, u32, struct deep_stacks, TRACE_STACK_THREADS);

struct offcpu_event {
    struct trace_head h;
    u32 tid;
    u32 tgid;
    u64 out_ns;                /* left the CPU */
    u64 enq_ns;                /* runnable again (woken; = out_ns when preempted; 0: not seen woken) */
    u64 in_ns;                 /* running again */
    u32 reason;                /* R_* */
    s32 kstack;                /* bytes of the kernel stack that follow, or -errno */
    s32 ustack;                /* bytes of the user stack after it, or -errno */
    u32 pad;
    u8 stacks[2 * TRACE_DEPTH * 8];
};
BPF_PERCPU_ARRAY(trace_scratch, struct offcpu_event, 1);   /* a record is put together here, then copied out */

/* Read the stacks `tid` leaves the CPU with into its trace_stacks entry; their lengths (or why none) into rec. */
static inline void trace_stacks_read(void *ctx, u32 tid, struct off_rec *rec)
{
    struct deep_stacks *st = trace_stacks.lookup(&tid);
    if (!st) {
        u32 zero = 0;
        struct offcpu_event *blank = trace_scratch.lookup(&zero);
        if (blank)
            trace_stacks.update(&tid, (struct deep_stacks *)blank->stacks);   /* any bytes: overwritten below */
        st = trace_stacks.lookup(&tid);
    }
    if (!st) {
        rec->kstack = rec->ustack = -12;     /* -ENOMEM: no room for one more thread */
        return;
    }
    rec->kstack = bpf_get_stack(ctx, st->k, sizeof(st->k), 0);
    rec->ustack = bpf_get_stack(ctx, st->u, sizeof(st->u), BPF_F_USER_STACK);
}

static inline void trace_offcpu(struct off_rec *rec, u64 now)
{
    /* A period whose end reads before its start (the wakeup's stamp from another vCPU's clock, a hair behind this
     * one's) ends where it began: recorded, 0 long — dropping it lost one voluntary switch in ~7 runs of ~23k. */
    if (now < rec->out_ns)
        now = rec->out_ns;
    if (now - rec->out_ns < job_trace_min_ns())
        return;
    u32 zero = 0, tid = rec->tid;
    struct offcpu_event *ev = trace_scratch.lookup(&zero);
    if (!ev)
        return;
    ev->h.kind = TRACE_OFFCPU;
    ev->h.slot = rec->slot;
    ev->tid = tid;
    ev->tgid = rec->tgid;
    ev->out_ns = rec->out_ns;
    ev->enq_ns = rec->enq_ns;
    ev->in_ns = now;
    ev->reason = rec->reason;
    ev->pad = 0;
    s32 klen = rec->kstack, ulen = rec->ustack;
    struct deep_stacks *st = (klen > 0 || ulen > 0) ? trace_stacks.lookup(&tid) : 0;
    if (!st) {                    /* emptied by user space since (no window open): says so */
        klen = klen > 0 ? -2 : klen;
        ulen = ulen > 0 ? -2 : ulen;
    }
    u32 kb = klen > 0 ? klen : 0, ub = ulen > 0 ? ulen : 0;
    if (kb > sizeof(st->k))
        kb = sizeof(st->k);
    if (ub > sizeof(st->u))
        ub = sizeof(st->u);
    if (st) {
        bpf_probe_read_kernel(ev->stacks, sizeof(st->k), st->k);
        bpf_probe_read_kernel(ev->stacks + kb, sizeof(st->u), st->u);
    }
    ev->kstack = klen;
    ev->ustack = ulen;
    u32 size = __builtin_offsetof(struct offcpu_event, stacks) + kb + ub;
    if (size > sizeof(*ev))
        size = sizeof(*ev);
    job_trace_output(ev->h.slot, ev, size);
}
#endif

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
 * little-endian, arm64's syscallno an int. bpf_task_pt_regs gives a BTF pointer to struct pt_regs: the verifier
 * checks each offset against the running kernel's BTF and makes the load a direct one (a fault reads 0), ~80 ns
 * less per switch-out than bpf_probe_read_kernel here (6.18 VM, bpf_stats: 23 vs 102 ns over an empty program). */
static inline u32 syscall_now(task_key task)
{
#ifdef BTF_SCHED
    unsigned long regs = (unsigned long)bpf_task_pt_regs(task);    /* task: current, as a BTF pointer already */
#else
    unsigned long regs = (unsigned long)bpf_task_pt_regs(bpf_get_current_task_btf());
#endif
    if (!regs)
        return 0;
    s32 nr = *(s32 *)(regs + SYSCALL_NR_OFF);
    unsigned long op = 0;
    if (nr == NR_FUTEX)
        op = *(unsigned long *)(regs + SYSCALL_ARG2_OFF);
    return syscall_reason(nr, op);
}
#endif

/* Why `tid` (current, being switched out) leaves the CPU, from its reported state. */
static inline u32 offcpu_reason(long state, u32 tid, task_key task)
{
    if (state == 0 || state == STATE_PREEMPTED_ASLEEP)
        return R_PREEMPT;
    if (state & STATE_D)
        return R_IO;
    if (state & (STATE_T | STATE_TRACED))
        return R_STOPPED;
#if defined(SYSCALL_FROM_REGS)
    if (state & STATE_S) {
        u32 r = syscall_now(task);
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

/* A seqcount per CPU and slot, so that user space can tell a consistent copy of the time arrays. A period's
 * open_n and open_ns (and done_ns at its close) are separate words: a copy taken between them is torn, and
 * open_n * t - open_ns is then off by a whole start time (a reading held the machine's uptime, ~10^13 ns, in a 1 s
 * interval). The kernel copies a per-CPU value word by word in increasing address order (bpf_long_memcpy, in
 * bpf_percpu_array_copy for lookups and batch lookups alike): seq_done, the first word, is read before anything
 * else, seq_begun, the last, after. Every write bumps seq_begun before its first store and seq_done after its last,
 * so a write that overlapped the copy leaves seq_done < seq_begun in it; a copy with the two equal saw no write
 * half done. The compiler barriers keep clang's stores in that order; the CPU keeps them there on x86 (stores are
 * seen in program order, and the copy's loads are not reordered with each other). On arm64 neither is promised and
 * a tear can escape the count: user space's bound on an interval (probes/sched.py settle) is the net there.
 * Only the CPU's own programs write its copy, and none of them interrupts another mid-write: sched_switch runs in
 * __schedule with the run queue locked and irqs off; sched_wakeup (try_to_wake_up, also from irqs) and
 * sched_wakeup_new (wake_up_new_task) run with a run queue locked, irqs off as well; the exit hook (forget, classic
 * tracepoints only: raw programs write no stats there) runs with irqs on, but a classic program that would run
 * inside it on its CPU is skipped by the kernel (bpf_prog_active, counted in bpf_missed), and every program of this
 * file is then classic. The scalar counters and the histogram are written outside the brackets too: each is one
 * word that only grows, a copy can at worst miss an increment that the next reading has. */
static inline void write_begin(struct slot_stats *s)
{
    s->seq_begun++;
    asm volatile("" ::: "memory");
}

static inline void write_end(struct slot_stats *s)
{
    asm volatile("" ::: "memory");
    s->seq_done++;
}

/* A period of category t opens at `since` (between write_begin and write_end). */
static inline void open_time(struct slot_stats *s, u32 t, u64 since)
{
    t &= NTIMES - 1;
    s->open_n[t]++;
    s->open_ns[t] += since;
}

/* The period of category t opened at `since` closes at `until` (>= since): its time moves to done_ns (between
 * write_begin and write_end). */
static inline void close_time(struct slot_stats *s, u32 t, u64 since, u64 until)
{
    t &= NTIMES - 1;
    s->open_n[t]--;
    s->open_ns[t] -= since;
    s->done_ns[t] += until - since;
}

/* Everything `rec` holds open closes at `now` (or at its own start, where a vCPU's clock reads a hair earlier),
 * and the entry is marked consumed. The normal end of an off-CPU period is its switch-in; an entry found still
 * open at a thread's next switch-out or at its exit (a switch-in the kernel skipped: bpf_missed) closes there,
 * so that no period stays open forever. */
static inline void finish_at(struct off_rec *rec, u64 now, u64 seen);

static inline void finish(struct off_rec *rec, u64 now)
{
    finish_at(rec, now, now);
}

/* finish, with `seen` the end a deep trace's event of the period takes (missed_end). */
static inline void finish_at(struct off_rec *rec, u64 now, u64 seen)
{
    if (rec->out_ns == 0 && rec->enq_ns == 0)
        return;
    u32 key = rec->slot;
    struct slot_stats *s = rec->epoch == epoch_of(key) ? stats.lookup(&key) : 0;
    if (s) {
        u64 end = now;
        write_begin(s);
        if (rec->out_ns) {
            if (rec->reason == R_PREEMPT || rec->enq_ns == 0) {   /* preempted, or a sleep not seen woken */
                if (end < rec->out_ns)
                    end = rec->out_ns;
                close_time(s, rec->reason, rec->out_ns, end);
            } else {                                              /* woken: its blocked part closed then */
                if (end < rec->enq_ns)
                    end = rec->enq_ns;
                close_time(s, T_WAKEUP, rec->enq_ns, end);
            }
            s->events[rec->reason & (NTIMES - 1)]++;
#ifdef JOB_DEEP_TRACE
            if (rec->tgid)
                trace_offcpu(rec, end > seen ? end : seen);
#endif
        }
        if (rec->enq_ns) {
            if (end < rec->enq_ns)
                end = rec->enq_ns;
            u64 delta = end - rec->enq_ns;
            u32 b = log2_floor(delta / 1000);
            if (b >= NBUCKETS)
                b = NBUCKETS - 1;
            close_time(s, T_RUNQ, rec->enq_ns, end);
            s->runq_events++;
            s->runq_hist[b]++;
        }
        write_end(s);
    }
    rec->out_ns = 0;   /* consumed: kept for the next switch-out, deleted when the thread exits */
    rec->enq_ns = 0;
    rec->tgid = 0;
}

/* The clock, read once per event and only where a record needs it (bpf_ktime_get_ns: ~75 ns in a 6.18 VM, the
 * dearest step of a switch; most of the node's switches are of no job and need none). */
static inline u64 clock_ns(u64 *now)
{
    if (*now == 0)
        *now = bpf_ktime_get_ns();
    return *now;
}

#if defined(BTF_SCHED) && defined(RQ_CLOCK_OFF) && TASK_CFS_RQ_OFF >= 0 && CFS_RQ_RQ_OFF >= 0 && RQ_CLOCK_OFF >= 0 \
    && RQ_CPU_OFF >= 0
/* The instant a member leaves its CPU without reading the clock (BTF programs, where the kernel's BTF has the
 * path: task_struct.se.cfs_rq -> cfs_rq.rq -> rq.clock, CONFIG_FAIR_GROUP_SCHED). __schedule stamps the run
 * queue's clock (sched_clock, the stamp the kernel's own schedstat run_delay uses) just before this tracepoint; an
 * offset per run queue turns it into CLOCK_MONOTONIC, bpf_ktime_get_ns's clock, that every other time here and
 * user space's tick use. The offset is learnt from the clock reads of the run queue's member switch-ins
 * (CLOCK_MONOTONIC at the tracepoint minus the stamp: an upper bound of the true offset, by the pick's time):
 * it is the least of them, allowed to grow since the last by 1/512 of the time between (~2000 ppm: the two clocks
 * drift apart only by NTP's frequency correction, <= 500 ppm) — so it never lies below the true offset and stays
 * within a few ns of the lowest recent read. A run queue with no read for CLOCK_STALE_NS starts afresh from the
 * clock. A wait started by a wakeup on another CPU is stamped with the offset of the run queue it waits on, the
 * one its switch-in uses: both ends of it then carry the same estimate, as the kernel's run_delay takes both from
 * that run queue's clock. (One offset per CPU, each learnt alone and renewed every 10 ms by a single read, put
 * the ends of a cross-CPU wait on two estimates µs apart: +0.1..3 µs per wait on a busy job.) The clock read was
 * the dearest step of a member's switch-out (bpf_ktime_get_ns, ~75 ns in a 6.18 VM). */
#define CLOCK_STALE_NS 10000000ULL
#define CLOCK_DRIFT_SHIFT 9
struct cpu_clock {
    u64 off;                   /* CLOCK_MONOTONIC - rq->clock on this run queue */
    u64 at;                    /* rq->clock at the last read; 0: none yet */
};
BPF_ARRAY(cpu_clock, struct cpu_clock, SCHED_NCPU);   /* by the run queue's CPU */

static inline void *rq_of(struct task_struct *t)
{
    /* direct loads through BTF pointers, each checked by the verifier against the running kernel's BTF (a fault
     * reads 0) */
    void *cfs = *(void **)((void *)t + TASK_CFS_RQ_OFF);
    return *(void **)(cfs + CFS_RQ_RQ_OFF);
}

/* The offset of run queue `rq` (its CPU's entry of cpu_clock); 0 where there is none. */
static inline struct cpu_clock *clock_of(void *rq)
{
    u32 cpu = *(int *)(rq + RQ_CPU_OFF);
    return cpu_clock.lookup(&cpu);
}

/* `now` (just read from the clock) against run queue stamp `sc`: the least offset, grown by the drift allowance. */
static inline void clock_seen(struct cpu_clock *c, u64 now, u64 sc)
{
    u64 off = now - sc;
    if (c->at && sc >= c->at && sc - c->at < CLOCK_STALE_NS) {
        u64 grown = c->off + ((sc - c->at) >> CLOCK_DRIFT_SHIFT);
        if ((s64)(grown - off) < 0)
            off = grown;
    }
    c->off = off;
    c->at = sc;
}

/* The instant of a scheduler event of `t` (a member leaving this CPU, or being woken): its run queue's stamp, which
 * the kernel renewed for this event, in CLOCK_MONOTONIC; or the clock itself (read into *now, for the rest of the
 * event) where the run queue's offset is stale or none can be had. A switch-in (`exact`) reads the clock to renew
 * the offset, and is stamped with the run queue's stamp too: the one __schedule took before its pick, where the
 * kernel ends the task's run_delay and starts its run time. The clock at this tracepoint reads later by the pick
 * and the switch's path (1.5..4 µs per switch on a 6.18 VM, more when the host is busy), which the waits would
 * otherwise gain and the kernel's figures do not. A switch-in renews the offset even where this switch's
 * switch-out read the clock already: were it stamped with that read instead, a CPU whose switches all go from one
 * member to another would never renew its offset, and every wait on it would end at the tracepoint's clock. */
static inline u64 stamp_ns(struct task_struct *t, u64 *now, int exact)
{
    void *rq = rq_of(t);
    u64 sc = *(u64 *)(rq + RQ_CLOCK_OFF);
    struct cpu_clock *c = clock_of(rq);
    if (!exact) {
        if (*now)
            return *now;
        if (c && sc && c->at && sc >= c->at && sc - c->at < CLOCK_STALE_NS)
            return sc + c->off;
    }
    if (*now == 0)
        *now = bpf_ktime_get_ns();
    if (c && sc) {
        clock_seen(c, *now, sc);
        if (exact)
            return sc + c->off;
    }
    return *now;
}
#if TASK_LAST_ARRIVAL_OFF >= 0
/* User space's latest reading of any slot (CLOCK_MONOTONIC, the instant its open periods were counted up to). */
BPF_ARRAY(read_at, u64, 1);

/* Where a period of `t` (switching out now, at `out`; open since `from`) whose switch-in no program saw ends:
 * when the kernel says `t` last came on a CPU (sched_info.last_arrival, its run queue's clock: CONFIG_SCHED_INFO),
 * in CLOCK_MONOTONIC — but never before user space's latest reading, which counted the period as open up to then
 * (closing it earlier would take back time an interval already reported). *over: the time counted open after the
 * thread was back on its CPU (end - that instant); without the kernel's stamp, the period ends at `out` and all of
 * it may be. *seen: the end a deep trace's event of the period takes (the kernel's stamp: not a running total). */
static inline u64 missed_end(struct task_struct *t, u64 from, u64 out, u64 *over, u64 *seen)
{
    u64 la = *(u64 *)((void *)t + TASK_LAST_ARRIVAL_OFF);
    u32 zero = 0;
    struct cpu_clock *c = clock_of(rq_of(t));
    u64 *read = read_at.lookup(&zero);
    u64 in = c && c->at && la ? la + c->off : 0;
    if (in < from || in > out) {
        *over = out - from;
        *seen = out;
        return out;
    }
    u64 end = read && *read > in && *read < out ? *read : in;
    *over = end - in;
    *seen = in;
    return end;
}
#define HAVE_MISSED_END
#endif
#else
static inline u64 stamp_ns(task_key t, u64 *now, int exact)
{
    return clock_ns(now);
}
#endif

#ifndef HAVE_MISSED_END
/* Without the kernel's stamp of a switch-in: the period ends at `out`, and all of it may have been run. */
static inline u64 missed_end(task_key t, u64 from, u64 out, u64 *over, u64 *seen)
{
    *over = out - from;
    *seen = out;
    return out;
}
#endif

/* Close what `task`'s entry holds open, then delete it (a thread's end). */
static inline void forget(task_key task, u64 now)
{
    struct off_rec *rec = rec_get(task);
    if (rec) {
        finish(rec, clock_ns(&now));
        rec_del(task);
    }
}

/* One context switch: prev (current; `prev` its key, `prev_tid` its thread id, 0 for an idle task) leaves the CPU
 * in reported state `state`, next (key `next`, 0 for an idle task) gets it. */
static inline int switched(void *ctx, task_key prev, u32 prev_tid, long state, task_key next)
{
    u64 now = 0;

    /* The tracepoint runs before the switch: "current" is still prev, so membership helpers see prev. */
    if (prev_tid != 0) {
#ifdef BTF_SCHED
        /* A member's record keeps its membership answer: valid while the membership generation has not moved
         * and the thread is in the same cgroups (its css_set), with no helper call. */
        struct off_rec *mine = rec_get(prev);
        u64 css = *(u64 *)((void *)prev + TASK_CGROUPS_OFF);
        u32 gen = job_membership_gen();
        int slot;
        if (mine && mine->mgen == gen && mine->css == css) {
            slot = job_slot_on(mine->mslot);
        } else {
            int raw = job_slot_cached_raw();
            if (mine) {
                mine->mslot = raw;
                mine->mgen = gen;
                mine->css = css;
            }
            slot = job_slot_on(raw);
        }
#else
        int slot = job_slot_cached();
#endif
        if (slot >= 0) {
            u32 key = slot;
            struct slot_stats *s = stats.lookup(&key);
            if (s) {
                if (state == 0 || state == STATE_PREEMPTED_ASLEEP)
                    s->involuntary++;
                else
                    s->voluntary++;
            }
            if (!(state & STATE_EXITING) && s) {
#ifdef JOB_DEEP_TRACE
                /* a traced job's periods are stamped with the clock itself, as its syscalls are: the run queue's
                 * stamp is the kernel's accounting instant, µs before the switch where __schedule skipped its
                 * clock update (a wakeup's preemption), and a trace lays the two side by side */
                u64 out = job_traced(slot) ? clock_ns(&now) : stamp_ns(prev, &now, 0);
#else
                u64 out = stamp_ns(prev, &now, 0);
#endif
                /* Preempted: runnable from this instant, so this is also its run-queue entry time. */
                struct off_rec rec = {.out_ns = out, .enq_ns = state == 0 ? out : 0, .slot = slot,
                                      .reason = offcpu_reason(state, prev_tid, prev), .tid = prev_tid,
                                      .kstack = -1, .ustack = -1, .epoch = epoch_of(slot)};
#ifdef BTF_SCHED
                rec.mslot = slot;
                rec.mgen = gen;
                rec.css = css;
#endif
#ifdef JOB_DEEP_TRACE
                if (job_traced(slot))
                    rec.tgid = bpf_get_current_pid_tgid() >> 32;   /* its stacks once its last period is out */
#endif
                /* A thread's entry stays from its first switch-out to its end: rewritten in place, it costs a
                 * lookup instead of a hash insert and delete per switch. */
#ifdef BTF_SCHED
                struct off_rec *old = mine;
#else
                struct off_rec *old = rec_get(prev);
#endif
                if (old && (old->out_ns || old->enq_ns)) {
                    /* Its switch-in was never seen: on this kernel a switch that ends a kernel worker's run
                     * now and then reaches no program (no recursion miss counted; the worker exits later).
                     * The period ends where the kernel says this thread last came on a CPU (missed_end);
                     * counted. */
                    u64 over = 0, seen = out, from = old->enq_ns > old->out_ns ? old->enq_ns : old->out_ns;
                    u64 end = missed_end(prev, from < out ? from : out, out, &over, &seen);
                    finish_at(old, end, seen);   /* a trace's event ends where the thread ran again */
                    s->switch_ins_missed++;
                    s->switch_in_missed_ns += over;
                }
#ifdef JOB_DEEP_TRACE
                if (rec.tgid)           /* after the period above is out: it is written with the stacks held */
                    trace_stacks_read(ctx, prev_tid, &rec);
#endif
                if (old)
                    *old = rec;
                else if (rec_put(prev, &rec))
                    goto next;          /* the map is full: this period is not counted, and nothing is opened */
                write_begin(s);
                open_time(s, rec.reason, out);
                if (state == 0)
                    open_time(s, T_RUNQ, out);
                write_end(s);
            }
        }
        if (state & STATE_EXITING) {
            /* Its last switch-out, member or not by now: job_exit may have dropped its process from the
             * membership maps, and a preemption late in do_exit can have written an entry after job_exit_hook
             * ran. Forgetting here, for every task that dies on the node, leaves no entry behind. */
            forget(prev, now);
#ifdef JOB_DEEP_TRACE
            trace_stacks.delete(&prev_tid);
#endif
#ifdef SYSCALL_HOOK
            in_call.delete(&prev_tid);
#endif
        }
    }

next:
    if (next == 0)
        return 0;
#if defined(RAW_SCHED) && !defined(BTF_SCHED)
    u32 zero = 0;
    u64 *idle = idle_task.lookup(&zero);
    if (idle) {
        if (prev_tid == 0)
            *idle = prev;       /* prev is this CPU's idle task */
        else if (next == *idle)
            return 0;           /* the idle task: never a member, no record */
    }
#endif
    struct off_rec *rec = rec_get(next);
    if (rec && (rec->out_ns || rec->enq_ns))   /* not a member: no entry; running already: consumed */
        finish(rec, rec->tgid ? clock_ns(&now)   /* traced: the clock itself (switched()) */
                              : stamp_ns(next, &now, 1));   /* the switch's own stamp; the clock renews the offset */
    return 0;
}

/* Fired when a sleeping (or not yet switched-in) task is put on a run queue. Only threads we saw leave the CPU
 * have an entry, so no membership check is needed here. The first wakeup wins: a task woken while already
 * runnable (preempted, or woken twice) has been waiting since the earlier time. */
static inline void woken(task_key task)
{
    struct off_rec *rec = rec_get(task);
    /* not off CPU (a consumed entry of a running thread), or runnable; or preempted on its way to sleep, woken
     * before it got there: on a run queue all along, and no wait the kernel counts (STATE_PREEMPTED_ASLEEP) */
    if (!rec || rec->out_ns == 0 || rec->enq_ns || rec->reason == R_PREEMPT)
        return;
    u64 clock = 0;
    u64 now = rec->tgid ? clock_ns(&clock) : stamp_ns(task, &clock, 0);   /* traced: the clock (switched()) */
    /* always after the switch-out (the waker needs prev off its CPU or its rq lock); a vCPU's clock may differ by
     * a hair */
    if (now < rec->out_ns)
        now = rec->out_ns;
    u32 key = rec->slot;
    struct slot_stats *s = rec->epoch == epoch_of(key) ? stats.lookup(&key) : 0;
    if (!s)
        return;
    rec->enq_ns = now;
    write_begin(s);
    close_time(s, rec->reason, rec->out_ns, now);   /* the sleep itself ends here */
    open_time(s, T_WAKEUP, now);
    open_time(s, T_RUNQ, now);
    write_end(s);
}

/* A new task has never been switched out; it joins its creator's job (current is the parent in
 * wake_up_new_task), and its first wait for a CPU counts as run-queue latency. */
static inline void woken_new(task_key task, u32 tid)
{
    int slot = job_slot_current();
    if (slot < 0)
        return;
    u32 key = slot;
    struct slot_stats *s = stats.lookup(&key);
    struct off_rec rec = {.out_ns = 0, .enq_ns = bpf_ktime_get_ns(), .slot = slot, .tid = tid, .kstack = -1,
                          .ustack = -1, .epoch = epoch_of(slot), .mslot = -1};
    struct off_rec *old = rec_get(task);
    if (old)
        finish(old, rec.enq_ns);   /* a reused key whose owner's end was missed: close what it held open */
    if (s && rec_put(task, &rec) == 0) {
        write_begin(s);
        open_time(s, T_RUNQ, rec.enq_ns);
        write_end(s);
    }
}

#ifndef RAW_SCHED
int on_switch(struct tracepoint__sched__sched_switch *args)
{
    return switched(args, args->prev_pid, args->prev_pid, args->prev_state & 0xff, args->next_pid);
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
        return st ? STATE_PREEMPTED_ASLEEP : 0;
    if (st & RAW_TASK_DEAD)
        return REPORTED_DEAD;
    if (st == RAW_TASK_IDLE)
        return REPORTED_IDLE;
    if (st & RAW_TASK_RTLOCK_WAIT)
        return STATE_D;
    st &= RAW_TASK_REPORT;
    return st ? 1 << log2_floor(st) : 0;
}

#ifdef BTF_SCHED
/* BTF tracepoint programs (tp_btf, -DBTF_SCHED with RAW_SCHED; loaded by jobprobe.kernel.bpf_loader): the same
 * arguments as raw ones, but typed, so that the task pointers can be handed to task storage and read directly at
 * offsets user space takes from the running kernel's BTF (TASK_PID_OFF, TASK_CGROUPS_OFF; the verifier checks each
 * against that BTF): no helper call for a thread id, no hash for a record, no lookup for the idle task (pid 0). */
static inline u32 task_tid(struct task_struct *t)
{
    return *(u32 *)((void *)t + TASK_PID_OFF);
}

int on_switch_btf(u64 *ctx)
{
    struct task_struct *prev = (struct task_struct *)ctx[1], *next = (struct task_struct *)ctx[2];
    return switched(ctx, prev, task_tid(prev), reported_state(ctx[0], (u32)ctx[3]), task_tid(next) ? next : 0);
}

int on_wakeup_btf(u64 *ctx)
{
    woken((struct task_struct *)ctx[0]);
    return 0;
}

int on_wakeup_new_btf(u64 *ctx)
{
    struct task_struct *p = (struct task_struct *)ctx[0];
    woken_new(p, task_tid(p));
    return 0;
}
#else
int on_switch_raw(struct bpf_raw_tracepoint_args *ctx)
{
    u32 prev_tid = bpf_get_current_pid_tgid();   /* current is prev; 0 for an idle task */
    return switched(ctx, ctx->args[1], prev_tid, reported_state(ctx->args[0], (u32)ctx->args[3]), ctx->args[2]);
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
