/* SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only */
/* common.h — job membership, shared by every eBPF probe (inlined by bpf.source() where a probe includes it).
 *
 * What: two maps say which job slot (0..MAX_SLOTS-1) the current task belongs to, so that every handler can
 *   drop events of other processes after one or two hash lookups, and aggregate per slot in the kernel.
 *     job_of_cgroup  cgroup2 id -> slot   filled by user space (the job's group and its descendants)
 *     job_of_tgid    tgid -> slot         filled by user space with the job's processes at attach; kept current
 *                                         here: forks of a member join, exits leave (no stale keys, no leaks)
 *   cgroup v2 hosts use the first; hybrid / v1 hosts (SLURM jobs left in the v2 root) the second.
 * Hooks: tracepoints sched:sched_process_fork, sched:sched_process_exit.
 * Oldest kernel: 4.18 (bpf_get_current_cgroup_id; BPF on tracepoints needs 4.7). The sched_process_exit field
 *   group_dead (recent kernels only) is used when user space says it exists (-DJOB_EXIT_HAS_GROUP_DEAD).
 * Cost: job_slot_current() is one array read plus one hash lookup per kind of membership in use (job_kinds);
 *   job_slot_cached() (sched) answers a task like the last one asked on its CPU from a per-CPU array;
 *   fork/exit add one lookup and at most one update/delete per process or thread created or ended.
 *
 * One owner per node: the maps and the fork/exit/exec handlers are compiled into bpf/membership.c (-DJOB_MEMBERSHIP)
 * and loaded once; every probe's module is compiled with -DJOB_PIN_DIR="<dir>" and finds the same three maps
 * pinned there (BPF_TABLE_PINNED: its loader pins the owner's map fds in a bpffs of its own, jobprobe/kernel/bpf_loader.py),
 * so a node has one set of membership handlers whatever the number of probes and jobs. Without JOB_PIN_DIR a
 * module owns private maps (tests of one program on its own).
 * Handlers are plain functions, attached by name from user space (job_fork → sched:sched_process_fork, job_exit →
 * sched:sched_process_exit), not bcc's auto-attached TRACEPOINT_PROBE: when one program of several fails to load,
 * bcc's constructor raises with the others already attached and no object left to detach them with.
 * A probe that keeps per-thread state defines JOB_ON_EXIT_HOOK and `static inline void job_exit_hook(u32 tid)`
 * before including this file: its own program on sched:sched_process_exit, job_exit_probe, calls it (and
 * JOB_ON_EXEC_HOOK / job_exec_hook: job_exec_probe on sched:sched_process_exec).
 * Per probe and job: `slots_on` (this module's own array, one bit per slot) says for which jobs the probe counts;
 * job_slot_current() answers -1 for a job whose bit is clear, so a probe switched off for one job does no work for
 * its events (one more array read for members only).
 * Deep-trace windows (jobprobe/tracewin.py): a module compiled with -DJOB_DEEP_TRACE (user space passes it where the
 * kernel has BPF ring buffers, 5.8) also gets `slots_traced` ([0]: one bit per slot in a window now; [1]: the
 * module's threshold in ns, set by user space) and `trace_ring`, a ring buffer where its handlers put one record
 * per event of a traced job (struct trace_head first: its kind and slot). job_traced() is one array read.
 */
#define MAX_SLOTS 64
#define MAX_MEMBER_TASKS 65536

#ifdef JOB_PIN_DIR
BPF_TABLE_PINNED("hash", u64, u32, job_of_cgroup, 4096, JOB_PIN_DIR "/job_of_cgroup");
BPF_TABLE_PINNED("hash", u32, u32, job_of_tgid, MAX_MEMBER_TASKS, JOB_PIN_DIR "/job_of_tgid");
BPF_TABLE_PINNED("array", u32, u32, job_kinds, 2, JOB_PIN_DIR "/job_kinds");
#else
BPF_HASH(job_of_cgroup, u64, u32, 4096);
/* Keyed by tgid for processes, but fork cannot tell a new thread from a new process (the tracepoint has no
 * clone flags), so members' threads get a key too (their tid); it is deleted when the thread exits. */
BPF_HASH(job_of_tgid, u32, u32, MAX_MEMBER_TASKS);
#endif
#ifndef JOB_MEMBERSHIP
BPF_ARRAY(slots_on, u64, 1);   /* bit s: this probe counts for the job in slot s (user space sets it) */
#endif

#ifdef JOB_DEEP_TRACE
#ifndef JOB_TRACE_PAGES
#define JOB_TRACE_PAGES 256    /* 1 MiB with 4 KiB pages: drained every tick */
#endif
BPF_ARRAY(slots_traced, u64, 2);
BPF_RINGBUF_OUTPUT(trace_ring, JOB_TRACE_PAGES);
BPF_ARRAY(trace_refused, u64, MAX_SLOTS);   /* per slot: records the ring refused (full, or its lock not taken) */

struct trace_head {
    u32 kind;                  /* the module's record kind */
    u32 slot;
};

/* Is the job in `slot` in a deep-trace window? */
static inline int job_traced(u32 slot)
{
    u32 zero = 0;
    u64 *bits = slots_traced.lookup(&zero);
    return bits && slot < MAX_SLOTS && ((*bits >> slot) & 1);
}

/* One record of a traced job into the ring; one the ring refuses is counted in trace_refused (user space adds it
 * to the window's records not kept): a window's shortfall is zero or counted. */
static inline void job_trace_output(u32 slot, void *ev, u32 size)
{
    if (trace_ring.ringbuf_output(ev, size, 0) != 0) {
        u64 *n = trace_refused.lookup(&slot);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
}

/* The module's threshold (ns): shorter intervals are not recorded one by one. */
static inline u64 job_trace_min_ns(void)
{
    u32 one = 1;
    u64 *min = slots_traced.lookup(&one);
    return min ? *min : 0;
}
#endif

/* floor(log2(v)), 0 for v <= 1: the bucket of a log2 histogram (callers clamp to their bucket count). Unrolled:
 * the verifier of older kernels refuses loops. */
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

/* Which kinds of membership are in use, set by user space: [0] bit 0, some job is watched by cgroup id; bit 1, by
 * tgid. A task of no job then costs one array read and one hash lookup, not two hash lookups. (0 before user space
 * has registered anything: nothing is a member yet.) [1] a generation, moved by user space after every change it
 * makes to the membership maps (job_slot_cached). */
#define JOB_BY_CGROUP 1
#define JOB_BY_TGID 2
#ifndef JOB_PIN_DIR
BPF_ARRAY(job_kinds, u32, 2);
#endif

/* `slot` if it is a job's slot and this module counts for that job (its slots_on bit; the membership owner has no
 * such bits), else -1. */
static inline int job_slot_on(int slot)
{
    if (slot < 0 || slot >= MAX_SLOTS)
        return -1;
#ifndef JOB_MEMBERSHIP
    u32 zero = 0;
    u64 *on = slots_on.lookup(&zero);
    if (!on || !((*on >> slot) & 1))
        return -1;
#endif
    return slot;
}

#ifdef JOB_SLOT_CACHE
/* job_slot_current() with this CPU's last answer kept: a module defining JOB_SLOT_CACHE (sched: a context switch
 * asks for the task leaving, and one CPU mostly alternates between the same few tasks) answers a task of the same
 * cgroup id and tgid as the last one asked, in the same membership generation, from a per-CPU array instead of a
 * hash lookup. User space moves the generation after each change it makes (an attach, a detach, a process or group
 * added); the kernel's own changes (a fork joins the parent's job; an exit leaves) concern tasks of another tgid or
 * tasks that will not run again. Only for programs that cannot interrupt one another on a CPU (sched_switch runs
 * with interrupts off): an entry is written field by field. */
struct job_cache {
    u64 cgid;
    u32 tgid;
    u32 gen;
    s32 slot;                  /* the answer before the module's own slots_on bit: -1, not a member */
    u32 valid;
};
BPF_PERCPU_ARRAY(job_cache, struct job_cache, 1);

/* The membership slot before the module's own slots_on bit (-1: not a member). */
static inline int job_slot_cached_raw(void)
{
    u32 zero = 0, one = 1;
    u32 *kinds = job_kinds.lookup(&zero), *gen = job_kinds.lookup(&one);
    struct job_cache *c = job_cache.lookup(&zero);
    if (!kinds || !gen || !c)
        return -1;
    u32 g = *gen;
    u64 cg = bpf_get_current_cgroup_id();
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    int slot;
    if (c->valid && c->gen == g && c->cgid == cg && c->tgid == tgid) {
        slot = c->slot;
    } else {
        u32 *s = 0;
        if (*kinds & JOB_BY_CGROUP)
            s = job_of_cgroup.lookup(&cg);
        if (!s && (*kinds & JOB_BY_TGID))
            s = job_of_tgid.lookup(&tgid);
        slot = (s && *s < MAX_SLOTS) ? (int)*s : -1;   /* (bounded before an int: a u32 ≥ 2^31 is no slot) */
        c->cgid = cg;
        c->tgid = tgid;
        c->gen = g;
        c->slot = slot;
        c->valid = 1;
    }
    return slot;
}

static inline int job_slot_cached(void)
{
    return job_slot_on(job_slot_cached_raw());
}

/* The membership generation now (job_kinds[1]): an answer kept elsewhere holds while it has not moved. */
static inline u32 job_membership_gen(void)
{
    u32 one = 1, *gen = job_kinds.lookup(&one);
    return gen ? *gen : 0;
}
#endif

/* The job slot of the task running now, or -1. Cgroup first: on v2 hosts that is the only lookup for members. */
static inline int job_slot_current(void)
{
    u32 zero = 0, *kinds = job_kinds.lookup(&zero);
    if (!kinds)
        return -1;
    u32 *slot = 0;
    if (*kinds & JOB_BY_CGROUP) {
        u64 cg = bpf_get_current_cgroup_id();
        slot = job_of_cgroup.lookup(&cg);
    }
    if (!slot && (*kinds & JOB_BY_TGID)) {
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        slot = job_of_tgid.lookup(&tgid);
    }
    if (!slot || *slot >= MAX_SLOTS)
        return -1;
    return job_slot_on((int)*slot);
}

#ifdef JOB_MEMBERSHIP

/* Runs in the parent's context. args->parent_pid is the forking *thread*'s id, which is not a key when a worker
 * thread forks, so the parent's tgid comes from the helper instead. */
int job_fork(struct tracepoint__sched__sched_process_fork *args)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *slot = job_of_tgid.lookup(&tgid);
    if (slot) {
        u32 child = args->child_pid, s = *slot;
        job_of_tgid.update(&child, &s);
    }
    return 0;
}

/* The processes of a job that exited, tgid -> slot, drained by user space each tick (Node.exited): whose a taskstats
 * exit record is when its process left the job's tree before it ended (double-forked, its shell gone first) and
 * lived less than a tick. Least recently used go first past its size: a burst of more exits than it holds between
 * two drains loses the oldest (user space then counts what it cannot claim). */
BPF_TABLE("lru_hash", u32, u32, job_exited, 16384);
BPF_ARRAY(job_exited_n, u64, MAX_SLOTS);   /* per slot: notes written, so that user space counts the ones lost */

/* Runs in the exiting task's context, once per thread. */
int job_exit(struct tracepoint__sched__sched_process_exit *args)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    /* whose it was, before its membership goes: its group's job (members by cgroup), else its process's */
    u32 zero = 0, *kinds = job_kinds.lookup(&zero), *slot = 0;
    if (kinds && (*kinds & JOB_BY_CGROUP)) {
        u64 cg = bpf_get_current_cgroup_id();
        slot = job_of_cgroup.lookup(&cg);
    }
    if (!slot)
        slot = job_of_tgid.lookup(&tgid);
    if (slot && tid == tgid && *slot < MAX_SLOTS) {   /* once per process: its leader's exit */
        u32 s = *slot;
        job_exited.update(&tgid, &s);
        u64 *n = job_exited_n.lookup(&s);
        if (n)
            __sync_fetch_and_add(n, 1);
    }
#ifdef JOB_EXIT_HAS_GROUP_DEAD
    /* Precise: a leader that ends early (pthread_exit in main) keeps the process a member until its last
     * thread is gone. */
    if (tid != tgid)
        job_of_tgid.delete(&tid);
    if (args->group_dead)
        job_of_tgid.delete(&tgid);
#else
    /* Without group_dead the leader's exit ends membership; its other threads exit right after in practice. */
    job_of_tgid.delete(&tid);
#endif
    return 0;
}

/* A non-leader thread that calls execve takes over the process's pid (the leader's); its own old tid never exits,
 * so its key would stay forever. Runs in the exec'ing task's context. */
int job_exec(struct tracepoint__sched__sched_process_exec *args)
{
    u32 old = args->old_pid, now = args->pid;
    if (old != now)
        job_of_tgid.delete(&old);
    return 0;
}
#endif /* JOB_MEMBERSHIP */

#ifdef JOB_ON_EXIT_HOOK
/* The probe's own exit program (sched:sched_process_exit), once per thread: its per-thread state goes. */
int job_exit_probe(struct tracepoint__sched__sched_process_exit *args)
{
    job_exit_hook((u32)bpf_get_current_pid_tgid());
    return 0;
}
#endif

#ifdef JOB_ON_EXEC_HOOK
/* The probe's own exec program (sched:sched_process_exec): a non-leader thread that execs takes the leader's pid;
 * the probe moves its per-thread state from the old tid to the new. */
int job_exec_probe(struct tracepoint__sched__sched_process_exec *args)
{
    u32 old = args->old_pid, now = args->pid;
    if (old != now)
        job_exec_hook(old, now);
    return 0;
}
#endif
