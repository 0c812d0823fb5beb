// SPDX-License-Identifier: Apache-2.0 OR GPL-2.0-only
/* cuda.c — what a job asks of its GPUs through the CUDA driver, the CUDA runtime and NCCL, seen from the CPU side.
 *
 * Per job slot, summed in the kernel into one per-CPU struct (user space reads one map element per tick, there is
 * no per-event output):
 *   kernel launches        cuLaunchKernel[Ex][_ptsz], cudaLaunchKernel[_ptsz], cudaLaunchKernelExC[_ptsz]
 *   memcpy calls and bytes by direction (HtoD, DtoH, DtoD, other: host to host and cudaMemcpyDefault)
 *                          cuMemcpy{HtoD,DtoH,DtoD}_v2[_ptds] and their Async_v2[_ptsz] forms (direction from the
 *                          function, bytes from ByteCount, arg 3); cudaMemcpy[_ptds], cudaMemcpyAsync[_ptsz]
 *                          (bytes arg 3, direction from the cudaMemcpyKind, arg 4)
 *   time blocked in synchronize: cuCtxSynchronize, cuStreamSynchronize[_ptsz], cudaDeviceSynchronize,
 *                          cudaStreamSynchronize[_ptsz]: entry to return, sum and log2 µs histogram
 *   NCCL collectives by type: calls, bytes (count × size of the ncclDataType_t) and time in the call:
 *                          ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclReduce (count arg 3,
 *                          datatype arg 4), ncclSend, ncclRecv (count arg 2, datatype arg 3)
 * Hooks: uprobes (and uretprobes where a call is timed or guards the layer below) on those functions, attached per
 *   library FILE by probes/cuda.py (perf_event_open on the uprobe PMU + PERF_EVENT_IOC_SET_BPF). A uprobe fires in
 *   every process that maps the file, so each program first asks job_slot_current() (common.h): the caller's
 *   cgroup or tgid decides, and everyone else returns after one or two hash lookups. Fork/exit from common.h.
 * One layer counts, never two: the runtime does its work through the driver (cudaMemcpy → cuMemcpyHtoD_v2,
 *   cudaDeviceSynchronize → cuCtxSynchronize), so a driver event inside a runtime call of the same thread is not
 *   counted; the runtime call already was. Which call is inside which is decided by the stack pointer: `calls`
 *   keeps, per thread and layer, the sp at entry of the outermost call in progress; an entry with a lower sp (a
 *   deeper frame) is nested in it, a return with a higher sp (the return address popped) is its end. So a record
 *   whose return was never seen (the process longjmp'd out, or the uretprobe was attached a moment after the
 *   uprobe) is overwritten by the thread's next call at the same depth instead of silencing it forever. Kernel
 *   launches made by NCCL are launches (NCCL is not a layer above the driver's launch accounting).
 * Oldest kernel: 4.18 (common.h); the uprobe PMU 4.17; bpf_probe_read_user is not used (arguments are registers).
 * Cost (6.18 VM, bpf_stats and wall time; probes/cuda.py has the table): each program 50-300 ns per run. The trap
 *   of each uprobe and uretprobe dominates and is paid by every process that calls a probed function, in the job or
 *   not: ~0.7-0.9 µs when the first instruction is emulated (push %rbp), 5-7 µs when it must be single-stepped
 *   (endbr64, rip-relative mov). A runtime launch or copy takes three traps (its uprobe and uretprobe, the
 *   driver's uprobe beneath).
 *   Memory: `calls` holds an entry only while a member thread is inside a timed or runtime call; it is removed at
 *   the return and at thread exit (job_exit_hook); 16 Ki entries of 96 bytes, preallocated (~2.5 MiB).
 */
#include <uapi/linux/ptrace.h>

#define NBUCKETS 27            /* log2 µs: bucket i holds [2^i, 2^(i+1)) µs, bucket 0 [0, 2); the last ≥ 2^26 µs */
#define NDIRS 4                /* HtoD, DtoH, DtoD, other */
#define DIR_OTHER 3
#define NCOLL 7                /* allreduce allgather reducescatter broadcast reduce send recv */
#ifndef MAX_CALL_THREADS
#define MAX_CALL_THREADS 16384  /* member threads with a call record, node-wide (a test makes it smaller) */
#endif

#define L_RT 0                 /* layers: CUDA runtime, CUDA driver, NCCL */
#define L_DRV 1
#define L_NCCL 2
#define NLAYERS 3

#define K_PLAIN 0              /* what a return finishes: nothing (launch/memcpy, counted at entry) */
#define K_SYNC 1               /*   a synchronize: count it and its time */
#define K_NCCL 2               /*   a collective: count it, its bytes and its time */

struct call_rec {
    u64 sp;                    /* stack pointer at entry; 0: no call in progress */
    u64 start_ns;
    u64 bytes;                 /* a collective's bytes */
    u32 slot;
    u16 kind;
    u8 coll;
    u8 known;                  /* a collective's datatype was known (bytes valid) */
    u16 op;                    /* OP_*: which call, for a deep-trace record */
    u16 sub;                   /* a copy's direction, a collective's type */
    u32 traced;                /* the job is in a deep-trace window: record this call at its return */
};

struct thread_calls {
    struct call_rec layer[NLAYERS];
};

struct cuda_stats {
    u64 launches;
    u64 memcpy_calls[NDIRS];
    u64 memcpy_bytes[NDIRS];
    u64 sync_calls;
    u64 sync_ns;
    u64 nccl_calls[NCOLL];
    u64 nccl_bytes[NCOLL];
    u64 nccl_ns[NCOLL];
    u64 nccl_unknown_dtype;
    u64 untracked;             /* calls that needed a per-thread record when `calls` was full: not counted */
    u64 sync_hist[NBUCKETS];
};

/* One entry per member thread inside a probed call (keyed by tid). */
BPF_HASH(calls, u32, struct thread_calls, MAX_CALL_THREADS);

#define JOB_ON_EXIT_HOOK
static inline void job_exit_hook(u32 tid)
{
    calls.delete(&tid);        /* a thread that ended inside a call (killed, or exit() from another thread) */
}

#include "common.h"

/* Deep-trace records: what a call was (OP_*; sub: a copy's direction, a collective's index). */
#define OP_RT_LAUNCH 1
#define OP_RT_MEMCPY 2
#define OP_RT_SYNC 3
#define OP_DRV_LAUNCH 4
#define OP_DRV_MEMCPY 5
#define OP_DRV_SYNC 6
#define OP_NCCL 7

#ifdef JOB_DEEP_TRACE
/* Deep-trace windows: each call of a traced job's thread, with its start and end (driver launches and copies,
 * which have no return probe: start == end). */
#define TRACE_CUDA 3
struct cuda_event {
    struct trace_head h;
    u32 tid;
    u32 tgid;
    u64 start_ns;
    u64 end_ns;
    u64 bytes;
    u16 op;
    u16 sub;
    u32 pad;
};

static inline void trace_call(u32 slot, u64 start, u64 end, u64 bytes, u16 op, u16 sub)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cuda_event ev = {.h = {.kind = TRACE_CUDA, .slot = slot}, .tid = (u32)id, .tgid = id >> 32,
                            .start_ns = start, .end_ns = end, .bytes = bytes, .op = op, .sub = sub};
    job_trace_output(ev.h.slot, &ev, sizeof(ev));
}
#endif

#if MAX_SLOTS != 64
#error "stats is sized for MAX_SLOTS == 64"
#endif
BPF_PERCPU_ARRAY(stats, struct cuda_stats, 64);


/* Sizes of ncclDataType_t values (nccl.h): int8 uint8 int32 uint32 int64 uint64 float16 float32 float64 bfloat16
 * float8e4m3 float8e5m2; 0 for a value this table does not know (a newer NCCL's type): bytes then unknown. */
static inline u64 nccl_type_size(u32 t)
{
    switch (t) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

static inline struct cuda_stats *stats_of(u32 slot)
{
    return stats.lookup(&slot);
}

/* Is this thread inside a call of `layer` that started in a shallower frame than `sp`? */
static inline int inside(struct thread_calls *t, u32 layer, u64 sp)
{
    return t && layer < NLAYERS && t->layer[layer].sp > sp;
}

/* Start a call that needs its return: the record of this thread's outermost call of the layer. Returns the record,
 * or 0 when the call is not the job's, or nested in an outer one that counts instead. */
static inline struct call_rec *enter(struct pt_regs *ctx, u32 layer)
{
    int slot = job_slot_current();
    if (slot < 0 || layer >= NLAYERS)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx);
    struct thread_calls zero = {};
    struct thread_calls *t = calls.lookup_or_try_init(&tid, &zero);
    if (!t) {                  /* map full: this call goes uncounted rather than unguarded — and says so */
        u32 key = slot;
        struct cuda_stats *s = stats.lookup(&key);
        if (s)
            s->untracked++;
        return 0;
    }
    if (layer == L_DRV && inside(t, L_RT, sp))
        return 0;              /* the runtime call above counts it */
    struct call_rec *r = &t->layer[layer];
    if (r->sp > sp)
        return 0;              /* nested in a call of the same layer */
    r->sp = sp;
    r->start_ns = bpf_ktime_get_ns();
    r->slot = slot;
    r->kind = K_PLAIN;
    r->bytes = 0;
    r->coll = 0;
    r->known = 0;
    r->op = 0;
    r->sub = 0;
#ifdef JOB_DEEP_TRACE
    r->traced = job_traced(slot);
#else
    r->traced = 0;
#endif
    return r;
}

/* A driver launch or copy: no return probe; counted unless inside a runtime call. Returns the stats or 0. */
static inline struct cuda_stats *driver_event(struct pt_regs *ctx, u16 op, u16 sub, u64 bytes)
{
    int slot = job_slot_current();
    if (slot < 0)
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (inside(calls.lookup(&tid), L_RT, PT_REGS_SP(ctx)))
        return 0;
#ifdef JOB_DEEP_TRACE
    if (job_traced(slot)) {
        u64 now = bpf_ktime_get_ns();
        trace_call(slot, now, now, bytes, op, sub);
    }
#endif
    return stats_of(slot);
}

static inline void count_copy(struct cuda_stats *s, const u32 dir, u64 bytes)
{
    __sync_fetch_and_add(&s->memcpy_calls[dir], 1);
    __sync_fetch_and_add(&s->memcpy_bytes[dir], bytes);
}

static inline void leave(struct pt_regs *ctx, u32 layer)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct thread_calls *t = calls.lookup(&tid);
    if (!t || layer >= NLAYERS)
        return;
    struct call_rec *r = &t->layer[layer];
    /* At a uretprobe the return address has been popped: sp is the entry's + 8. A lower one is a nested call's. */
    if (r->sp == 0 || PT_REGS_SP(ctx) <= r->sp)
        return;
    u64 end = bpf_ktime_get_ns(), dt = end - r->start_ns;
#ifdef JOB_DEEP_TRACE
    if (r->traced)
        trace_call(r->slot, r->start_ns, end, r->bytes, r->op, r->sub);
#endif
    struct cuda_stats *s = stats_of(r->slot);
    if (s && r->kind == K_SYNC) {
        __sync_fetch_and_add(&s->sync_calls, 1);
        __sync_fetch_and_add(&s->sync_ns, dt);
        u32 b = log2_floor(dt / 1000);
        if (b >= NBUCKETS)
            b = NBUCKETS - 1;
        __sync_fetch_and_add(&s->sync_hist[b], 1);
    } else if (s && r->kind == K_NCCL) {
        u32 c = r->coll;
        if (c < NCOLL) {
            __sync_fetch_and_add(&s->nccl_calls[c], 1);
            __sync_fetch_and_add(&s->nccl_ns[c], dt);
            if (r->known)
                __sync_fetch_and_add(&s->nccl_bytes[c], r->bytes);
            else
                __sync_fetch_and_add(&s->nccl_unknown_dtype, 1);
        }
    }
    r->sp = 0;
    if (t->layer[0].sp == 0 && t->layer[1].sp == 0 && t->layer[2].sp == 0)
        calls.delete(&tid);    /* no call left in progress: keep the map as small as the calls in flight */
}

/* ---- CUDA runtime (libcudart) -------------------------------------------------------------------------------- */

int rt_launch(struct pt_regs *ctx)
{
    struct call_rec *r = enter(ctx, L_RT);
    struct cuda_stats *s = r ? stats_of(r->slot) : 0;
    if (r)
        r->op = OP_RT_LAUNCH;
    if (s)
        __sync_fetch_and_add(&s->launches, 1);
    return 0;
}

int rt_memcpy(struct pt_regs *ctx)
{
    struct call_rec *r = enter(ctx, L_RT);
    struct cuda_stats *s = r ? stats_of(r->slot) : 0;
    if (!s)
        return 0;
    u64 bytes = PT_REGS_PARM3(ctx);
    u32 kind = (u32)PT_REGS_PARM4(ctx);
    r->op = OP_RT_MEMCPY;
    r->sub = kind >= 1 && kind <= 3 ? kind - 1 : DIR_OTHER;
    r->bytes = bytes;           /* (a plain call's bytes: only its trace record reads them) */
    /* cudaMemcpyKind: 1 HtoD, 2 DtoH, 3 DtoD; 0 host to host and 4 default (from the pointers) are "other". A switch
     * with constant directions: a computed index loses its bounds in the verifier's eyes. */
    switch ((u32)PT_REGS_PARM4(ctx)) {
    case 1: count_copy(s, 0, bytes); break;
    case 2: count_copy(s, 1, bytes); break;
    case 3: count_copy(s, 2, bytes); break;
    default: count_copy(s, DIR_OTHER, bytes); break;
    }
    return 0;
}

int rt_sync(struct pt_regs *ctx)
{
    struct call_rec *r = enter(ctx, L_RT);
    if (r) {
        r->kind = K_SYNC;
        r->op = OP_RT_SYNC;
    }
    return 0;
}

int rt_ret(struct pt_regs *ctx)
{
    leave(ctx, L_RT);
    return 0;
}

/* ---- CUDA driver (libcuda) ----------------------------------------------------------------------------------- */

int drv_launch(struct pt_regs *ctx)
{
    struct cuda_stats *s = driver_event(ctx, OP_DRV_LAUNCH, 0, 0);
    if (s)
        __sync_fetch_and_add(&s->launches, 1);
    return 0;
}

#define DRIVER_COPY(fn, dir) \
    int fn(struct pt_regs *ctx) \
    { \
        struct cuda_stats *s = driver_event(ctx, OP_DRV_MEMCPY, dir, PT_REGS_PARM3(ctx)); \
        if (s) \
            count_copy(s, dir, PT_REGS_PARM3(ctx)); \
        return 0; \
    }
DRIVER_COPY(drv_htod, 0)
DRIVER_COPY(drv_dtoh, 1)
DRIVER_COPY(drv_dtod, 2)

int drv_sync(struct pt_regs *ctx)
{
    struct call_rec *r = enter(ctx, L_DRV);
    if (r) {
        r->kind = K_SYNC;
        r->op = OP_DRV_SYNC;
    }
    return 0;
}

int drv_ret(struct pt_regs *ctx)
{
    leave(ctx, L_DRV);
    return 0;
}

/* ---- NCCL (libnccl) ------------------------------------------------------------------------------------------ */

static inline void collective(struct pt_regs *ctx, u32 coll, u64 count, u32 dtype)
{
    struct call_rec *r = enter(ctx, L_NCCL);
    if (!r)
        return;
    u64 size = nccl_type_size(dtype);
    r->kind = K_NCCL;
    r->op = OP_NCCL;
    r->sub = coll;
    r->coll = coll;
    r->known = size != 0;
    r->bytes = count * size;
}

/* count is arg 3 and the datatype arg 4, except for send/recv (2 and 3). */
#define COLLECTIVE(fn, coll) \
    int fn(struct pt_regs *ctx) \
    { \
        collective(ctx, coll, PT_REGS_PARM3(ctx), (u32)PT_REGS_PARM4(ctx)); \
        return 0; \
    }
COLLECTIVE(nccl_allreduce, 0)
COLLECTIVE(nccl_allgather, 1)
COLLECTIVE(nccl_reducescatter, 2)
COLLECTIVE(nccl_broadcast, 3)
COLLECTIVE(nccl_reduce, 4)

int nccl_send(struct pt_regs *ctx)
{
    collective(ctx, 5, PT_REGS_PARM2(ctx), (u32)PT_REGS_PARM3(ctx));
    return 0;
}

int nccl_recv(struct pt_regs *ctx)
{
    collective(ctx, 6, PT_REGS_PARM2(ctx), (u32)PT_REGS_PARM3(ctx));
    return 0;
}

int nccl_ret(struct pt_regs *ctx)
{
    leave(ctx, L_NCCL);
    return 0;
}
