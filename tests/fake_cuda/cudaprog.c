// SPDX-License-Identifier: Apache-2.0
/* cudaprog.c — A TEST FAKE workload: a "CUDA application" for tests/test_cuda.py, run against the fake libraries of
 * this folder (never against real ones). It dlopen()s libcuda.so.1, libcudart.so.12 and libnccl.so.2 by soname (the
 * test puts the fakes first on LD_LIBRARY_PATH), makes an exact number of calls of each kind with known sizes, and
 * prints its own account (JSON, keys named like the probe's fields) as the ground truth.
 *
 *   cudaprog            commands on stdin, one per line, each answered with one line on stdout:
 *     load cuda|cudart|nccl    dlopen the library, resolve its hooked functions           → "ok"
 *     addr NAME                where the dynamic linker put a resolved function         → "0x…"
 *     probed                   how many resolved functions start with an int3 (0xcc): a uprobe is installed there
 *                              (the kernel writes the breakpoint into every mapping of the file)  → "N of M"
 *     run driver|runtime|nccl N    the calls of one phase, N of each kind               → the phase's JSON account
 *     hang N                   N threads block in cuStreamSynchronize and N in cudaStreamSynchronize forever
 *                              (FAKE_STREAM_HANG), answered once all 2N are inside the fake driver → "hung"
 *     bench drv|rt|copy N      N calls of cuLaunchKernel / cudaLaunchKernel / cuMemcpyHtoD_v2 in a tight loop
 *                              → the loop's wall time in ns (the cost of the probes on each call, on vs off)
 *     quit
 *   cudaprog auto N FILE   what an application does on its own: load the driver and runtime, wait until every
 *                          hooked function carries a breakpoint (+1 s for the attach to finish), run driver and
 *                          runtime; 1.5 s later load NCCL ("loaded later"), wait likewise, run nccl; write the
 *                          summed account to FILE.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "fake_types.h"

#define MAXFN 64
static struct { const char *name; void *fn; } fns[MAXFN];
static int nfns;
static void *libs[3];
static const char *const SONAMES[3] = {"libcuda.so.1", "libcudart.so.12", "libnccl.so.2"};
static const char *const HOOKED[3] = {
    "cuLaunchKernel cuLaunchKernel_ptsz cuLaunchKernelEx cuLaunchKernelEx_ptsz cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 "
    "cuMemcpyDtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoH_v2_ptds cuMemcpyDtoD_v2_ptds cuMemcpyHtoDAsync_v2 "
    "cuMemcpyDtoHAsync_v2 cuMemcpyDtoDAsync_v2 cuMemcpyHtoDAsync_v2_ptsz cuMemcpyDtoHAsync_v2_ptsz "
    "cuMemcpyDtoDAsync_v2_ptsz cuCtxSynchronize cuStreamSynchronize cuStreamSynchronize_ptsz",
    "cudaLaunchKernel cudaLaunchKernel_ptsz cudaLaunchKernelExC cudaLaunchKernelExC_ptsz cudaMemcpy cudaMemcpy_ptds "
    "cudaMemcpyAsync cudaMemcpyAsync_ptsz cudaDeviceSynchronize cudaStreamSynchronize cudaStreamSynchronize_ptsz",
    "ncclAllReduce ncclAllGather ncclReduceScatter ncclBroadcast ncclReduce ncclSend ncclRecv",
};

static void die(const char *what) { fprintf(stderr, "cudaprog: %s\n", what); exit(2); }

static void *fn(const char *name)
{
    for (int i = 0; i < nfns; i++)
        if (!strcmp(fns[i].name, name))
            return fns[i].fn;
    die(name);
    return 0;
}

static void load(int which)
{
    if (libs[which])
        return;
    if (!(libs[which] = dlopen(SONAMES[which], RTLD_NOW)))
        die(dlerror());
    char names[1024], *save, *tok;
    snprintf(names, sizeof names, "%s", HOOKED[which]);
    for (tok = strtok_r(names, " ", &save); tok; tok = strtok_r(0, " ", &save)) {
        if (nfns == MAXFN)
            die("too many functions");
        fns[nfns].name = strdup(tok);
        if (!(fns[nfns++].fn = dlsym(libs[which], tok)))
            die(tok);
    }
}

static int probed(void)
{
    int n = 0;
    for (int i = 0; i < nfns; i++)
        n += *(volatile unsigned char *)fns[i].fn == 0xcc;
    return n;
}

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The account. Keys are the probe's field names; *_min_ns are lower bounds (the fakes' sleeps), *_wall_ns our own
 * clock around each call (an upper bound of what the probe can see between entry and return). */
enum { LAUNCHES, HTOD_C, HTOD_B, DTOH_C, DTOH_B, DTOD_C, DTOD_B, OTHER_C, OTHER_B, SYNC_C, SYNC_MIN, SYNC_WALL,
       NCCL0 };   /* then per collective: calls, bytes, min_ns, wall_ns */
#define NCOLL 7
#define NKEYS (NCCL0 + 4 * NCOLL + 1)
static const char *const COLL[NCOLL] = {"allreduce", "allgather", "reducescatter", "broadcast", "reduce", "send",
                                        "recv"};
static long long tally[NKEYS];
#define UNKNOWN_DTYPE (NKEYS - 1)

static void print_acct(FILE *out, long long *a)
{
    static const char *const names[NCCL0] = {"kernel_launches", "memcpy_htod_calls", "memcpy_htod_bytes",
        "memcpy_dtoh_calls", "memcpy_dtoh_bytes", "memcpy_dtod_calls", "memcpy_dtod_bytes", "memcpy_other_calls",
        "memcpy_other_bytes", "sync_calls", "sync_min_ns", "sync_wall_ns"};
    fprintf(out, "{");
    for (int i = 0; i < NCCL0; i++)
        fprintf(out, "\"%s\": %lld, ", names[i], a[i]);
    for (int c = 0; c < NCOLL; c++)
        fprintf(out, "\"nccl_%s_calls\": %lld, \"nccl_%s_bytes\": %lld, \"nccl_%s_min_ns\": %lld, "
                "\"nccl_%s_wall_ns\": %lld, ", COLL[c], a[NCCL0 + 4 * c], COLL[c], a[NCCL0 + 4 * c + 1], COLL[c],
                a[NCCL0 + 4 * c + 2], COLL[c], a[NCCL0 + 4 * c + 3]);
    fprintf(out, "\"nccl_unknown_dtype_calls\": %lld}\n", a[UNKNOWN_DTYPE]);
    fflush(out);
}

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*copy_fn)(unsigned long long, unsigned long long, size_t);
typedef CUresult (*copy_async_fn)(unsigned long long, unsigned long long, size_t, CUstream);
typedef CUresult (*void_fn)(void);
typedef CUresult (*stream_fn)(CUstream);
typedef cudaError_t (*rt_launch_fn)(const void *, dim3, dim3, void **, size_t, cudaStream_t);
typedef cudaError_t (*rt_launch_ex_fn)(const cudaLaunchConfig_t *, const void *, void **);
typedef cudaError_t (*rt_copy_fn)(void *, const void *, size_t, enum cudaMemcpyKind);
typedef cudaError_t (*rt_copy_async_fn)(void *, const void *, size_t, enum cudaMemcpyKind, cudaStream_t);

static void timed_sync(void_fn f, long long min_ns)
{
    long long t = now_ns();
    f();
    tally[SYNC_WALL] += now_ns() - t;
    tally[SYNC_MIN] += min_ns;
    tally[SYNC_C]++;
}

static void timed_stream_sync(stream_fn f, long long min_ns)
{
    long long t = now_ns();
    f((CUstream)0);
    tally[SYNC_WALL] += now_ns() - t;
    tally[SYNC_MIN] += min_ns;
    tally[SYNC_C]++;
}

/* direction index 0..2 (HtoD, DtoH, DtoD) → account slots */
static void count_copy(int dir, size_t n)
{
    tally[HTOD_C + 2 * dir]++;
    tally[HTOD_B + 2 * dir] += (long long)n;
}

static void run_driver(int n)
{
    static const char *const launches[] = {"cuLaunchKernel", "cuLaunchKernel_ptsz"};
    static const char *const ex[] = {"cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"};
    static const char *const copies[3][2] = {{"cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds"},
        {"cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds"}, {"cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds"}};
    static const char *const asyncs[3][2] = {{"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"},
        {"cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz"}, {"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz"}};
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < n; i++) {
            ((launch_fn)fn(launches[v]))(0, 1, 1, 1, 128, 1, 1, 0, 0, 0, 0);
            ((launch_ex_fn)fn(ex[v]))(0, 0, 0, 0);
            tally[LAUNCHES] += 2;
            for (int d = 0; d < 3; d++) {
                size_t sz = (size_t)4096 * (d + 1) + (size_t)i * 7 + v, asz = sz * 3 + 1;
                ((copy_fn)fn(copies[d][v]))(0x1000, 0x2000, sz);
                ((copy_async_fn)fn(asyncs[d][v]))(0x1000, 0x2000, asz, 0);
                count_copy(d, sz);
                count_copy(d, asz);
            }
        }
    for (int i = 0; i < (n + 9) / 10; i++) {   /* a tenth as many: each sleeps 1-2 ms */
        timed_sync((void_fn)fn("cuCtxSynchronize"), 2000000);
        timed_stream_sync((stream_fn)fn("cuStreamSynchronize"), 1000000);
        timed_stream_sync((stream_fn)fn("cuStreamSynchronize_ptsz"), 1000000);
    }
}

static void run_runtime(int n)
{
    static const char *const launches[] = {"cudaLaunchKernel", "cudaLaunchKernel_ptsz"};
    static const char *const ex[] = {"cudaLaunchKernelExC", "cudaLaunchKernelExC_ptsz"};
    static const char *const copies[] = {"cudaMemcpy", "cudaMemcpy_ptds"};
    static const char *const asyncs[] = {"cudaMemcpyAsync", "cudaMemcpyAsync_ptsz"};
    dim3 g = {1, 1, 1}, b = {256, 1, 1};
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < n; i++) {
            ((rt_launch_fn)fn(launches[v]))(0, g, b, 0, 0, 0);
            ((rt_launch_ex_fn)fn(ex[v]))(0, 0, 0);
            tally[LAUNCHES] += 2;
            for (int kind = 0; kind <= 4; kind++) {   /* 0 and 4 (host to host, default) count as "other" */
                size_t sz = (size_t)1000 * (kind + 1) + (size_t)i * 13 + v, asz = sz + 11;
                ((rt_copy_fn)fn(copies[v]))((void *)0x1000, (void *)0x2000, sz, kind);
                ((rt_copy_async_fn)fn(asyncs[v]))((void *)0x1000, (void *)0x2000, asz, kind, 0);
                int dir = kind >= 1 && kind <= 3 ? kind - 1 : 3;
                count_copy(dir, sz);
                count_copy(dir, asz);
            }
        }
    for (int i = 0; i < (n + 9) / 10; i++) {
        timed_sync((void_fn)fn("cudaDeviceSynchronize"), 2000000);
        timed_stream_sync((stream_fn)fn("cudaStreamSynchronize"), 1000000);
        timed_stream_sync((stream_fn)fn("cudaStreamSynchronize_ptsz"), 1000000);
    }
}

/* ncclDataType_t sizes in bytes, 0..11 (nccl.h); 12 and 99 are not types: their bytes are unknown. */
static const int DTYPE_SIZE[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};

static void run_nccl(int n)
{
    typedef ncclResult_t (*coll7)(const void *, void *, size_t, ncclDataType_t, int, void *, void *);
    typedef ncclResult_t (*coll8)(const void *, void *, size_t, ncclDataType_t, int, int, void *, void *);
    typedef ncclResult_t (*coll6)(const void *, void *, size_t, ncclDataType_t, void *, void *);
    typedef ncclResult_t (*p2p)(const void *, size_t, ncclDataType_t, int, void *, void *);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < NCOLL; c++) {
            int dt = i % 14 == 12 ? 12 : i % 14 == 13 ? 99 : i % 14;
            size_t count = (size_t)1024 * (c + 1) + (size_t)i * 3;
            void *s = (void *)0x1000, *r = (void *)0x2000;
            long long t = now_ns();
            switch (c) {
            case 0: ((coll7)fn("ncclAllReduce"))(s, r, count, dt, 0, 0, 0); break;
            case 1: ((coll6)fn("ncclAllGather"))(s, r, count, dt, 0, 0); break;
            case 2: ((coll7)fn("ncclReduceScatter"))(s, r, count, dt, 0, 0, 0); break;
            case 3: ((coll7)fn("ncclBroadcast"))(s, r, count, dt, 0, 0, 0); break;
            case 4: ((coll8)fn("ncclReduce"))(s, r, count, dt, 0, 0, 0, 0); break;
            case 5: ((p2p)fn("ncclSend"))(s, count, dt, 1, 0, 0); break;
            case 6: ((p2p)fn("ncclRecv"))(r, count, dt, 1, 0, 0); break;
            }
            long long *a = &tally[NCCL0 + 4 * c];
            a[3] += now_ns() - t;
            a[2] += 200000;        /* fake_nccl.c FAKE_NCCL_NS */
            a[0]++;
            if (dt < 12)
                a[1] += (long long)count * DTYPE_SIZE[dt];
            else
                tally[UNKNOWN_DTYPE]++;
            tally[LAUNCHES]++;      /* each fake collective launches one kernel through the driver */
        }
}

static void *hang_thread(void *arg)
{
    ((stream_fn)fn(arg ? "cudaStreamSynchronize" : "cuStreamSynchronize"))(FAKE_STREAM_HANG);
    return 0;
}

static void run(const char *phase, int n)
{
    memset(tally, 0, sizeof tally);
    if (!strcmp(phase, "driver"))
        run_driver(n);
    else if (!strcmp(phase, "runtime"))
        run_runtime(n);
    else if (!strcmp(phase, "nccl"))
        run_nccl(n);
    else
        die(phase);
}

static long long bench(const char *what, int n)
{
    dim3 g = {1, 1, 1}, b = {256, 1, 1};
    long long t = now_ns();
    if (!strcmp(what, "drv")) {
        launch_fn f = (launch_fn)fn("cuLaunchKernel");
        for (int i = 0; i < n; i++)
            f(0, 1, 1, 1, 128, 1, 1, 0, 0, 0, 0);
    } else if (!strcmp(what, "rt")) {
        rt_launch_fn f = (rt_launch_fn)fn("cudaLaunchKernel");
        for (int i = 0; i < n; i++)
            f(0, g, b, 0, 0, 0);
    } else if (!strcmp(what, "copy")) {
        copy_fn f = (copy_fn)fn("cuMemcpyHtoD_v2");
        for (int i = 0; i < n; i++)
            f(0x1000, 0x2000, 4096);
    } else {
        die(what);
    }
    return now_ns() - t;
}

static int lib_index(const char *name)
{
    return !strcmp(name, "cuda") ? 0 : !strcmp(name, "cudart") ? 1 : !strcmp(name, "nccl") ? 2 : (die(name), 0);
}

static void wait_probed(void)
{
    for (int i = 0; probed() < nfns; i++) {
        if (i > 6000)
            die("no uprobes on the hooked functions after 60 s");
        usleep(10000);
    }
    sleep(1);   /* the breakpoint appears at the first attachment of a function: let the others finish */
}

static int run_auto(int n, const char *file)
{
    long long total[NKEYS] = {0};
    load(0);
    load(1);
    wait_probed();
    const char *phases[] = {"driver", "runtime", "nccl"};
    for (int p = 0; p < 3; p++) {
        if (p == 2) {
            usleep(1500000);
            load(2);
            wait_probed();
        }
        run(phases[p], n);
        for (int k = 0; k < NKEYS; k++)
            total[k] += tally[k];
    }
    FILE *out = fopen(file, "w");
    if (!out)
        die(file);
    print_acct(out, total);
    fclose(out);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "auto"))
        return run_auto(atoi(argv[2]), argv[3]);
    char line[256], a[64];
    int n;
    while (fgets(line, sizeof line, stdin)) {
        if (sscanf(line, "load %63s", a) == 1) {
            load(lib_index(a));
            printf("ok\n");
        } else if (sscanf(line, "addr %63s", a) == 1) {
            printf("%p\n", fn(a));
        } else if (!strncmp(line, "probed", 6)) {
            printf("%d of %d\n", probed(), nfns);
        } else if (sscanf(line, "run %63s %d", a, &n) == 2) {
            run(a, n);
            print_acct(stdout, tally);
        } else if (sscanf(line, "hang %d", &n) == 1) {
            volatile int *hung = dlsym(libs[0], "fake_hung");
            pthread_t t;
            for (int i = 0; i < 2 * n; i++)
                if (pthread_create(&t, 0, hang_thread, (void *)(long)(i % 2)))
                    die("pthread_create");
            while (*hung < 2 * n)
                usleep(1000);
            printf("hung\n");
        } else if (sscanf(line, "bench %63s %d", a, &n) == 2) {
            printf("%lld\n", bench(a, n));
        } else if (!strncmp(line, "quit", 4)) {
            return 0;
        } else {
            die(line);
        }
        fflush(stdout);
    }
    return 0;
}
