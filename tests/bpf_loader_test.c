// SPDX-License-Identifier: Apache-2.0
/* bpf_loader_test.c — a test-only eBPF program for tests/test_bpf_loader.py (never shipped, never registered).
 *
 * What: one map of each shape the agent reads, and a handler that writes to them.
 *   counts  hash u32 -> u64, filled and read from user space (element ops, iteration, batch lookups)
 *   percpu  per-CPU array of a 12-byte struct: user space sees it padded to 16 bytes per possible CPU
 *   watch   hash cgroup2 id -> u32: on_switch counts, per CPU, switches out of tasks in a watched group
 * Hooks: tracepoint sched:sched_switch (on_switch), attached by name by the test.
 * Oldest kernel: 4.18 (bpf_get_current_cgroup_id). Cost: one hash lookup per context switch, while attached.
 * -DBREAK_VERIFIER adds an unbounded map-value access the verifier must reject; -DBREAK_COMPILE a syntax error.
 */
struct pc {
    u32 switches;
    u32 tag;
    u32 spare;
};

BPF_HASH(counts, u32, u64, 1024);
BPF_PERCPU_ARRAY(percpu, struct pc, 4);
BPF_HASH(watch, u64, u32, 16);

#ifdef BREAK_COMPILE
this is not C;
#endif

int on_switch(struct tracepoint__sched__sched_switch *args)
{
    u64 cg = bpf_get_current_cgroup_id();   /* prev's group: the tracepoint runs before the switch */
    if (!watch.lookup(&cg))
        return 0;
    u32 zero = 0;
    struct pc *p = percpu.lookup(&zero);
    if (!p)
        return 0;
    p->switches++;
#ifdef BREAK_VERIFIER
    u32 *words = (u32 *)p;
    words[args->prev_pid]++;                /* any pid: far outside the 12-byte value */
#endif
    return 0;
}
