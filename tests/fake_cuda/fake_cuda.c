// SPDX-License-Identifier: Apache-2.0
/* fake_cuda.c — A TEST FAKE of NVIDIA's driver library libcuda.so.1. It drives no GPU and must never be installed.
 *
 * Compiled by tests/test_cuda.py as libcuda.so.1 (soname included). It exports the REAL driver symbol names with the
 * real argument order (cuda.h, CUDA 12), so that uprobes placed by symbol name see the arguments where the real
 * library would have them. Bodies do trivial work; the synchronizes sleep a known time so that the probe's blocked
 * time can be checked against a lower bound that nanosleep guarantees:
 *   cuCtxSynchronize      2 ms        cuStreamSynchronize   1 ms (forever on FAKE_STREAM_HANG)
 * The _ptsz/_ptds names are the per-thread-default-stream variants that cuda.h selects with
 * CUDA_API_PER_THREAD_DEFAULT_STREAM; the real library exports them as separate functions, and so does this fake.
 */
#include <time.h>
#include <unistd.h>
#include "fake_types.h"

#define API __attribute__((visibility("default"), noinline))

volatile unsigned long long fake_cuda_launches, fake_cuda_bytes;
volatile int fake_hung;   /* threads now blocked in a synchronize on FAKE_STREAM_HANG */

static void sleep_ns(long ns)
{
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

API CUresult cuInit(unsigned int flags) { (void)flags; return 0; }

API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                            unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **params,
                            void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)params;
    (void)extra;
    fake_cuda_launches++;
    return 0;
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                 unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **params,
                                 void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)s; (void)params;
    (void)extra;
    fake_cuda_launches++;
    return 0;
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    (void)config; (void)f; (void)params; (void)extra;
    fake_cuda_launches++;
    return 0;
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params, void **extra)
{
    (void)config; (void)f; (void)params; (void)extra;
    fake_cuda_launches++;
    return 0;
}

/* Copies: the pointers are fake device addresses, so nothing is dereferenced; the size is the ground truth. */
#define COPY(name, dst_t, src_t) \
    API CUresult name(dst_t dst, src_t src, size_t n) { (void)dst; (void)src; fake_cuda_bytes += n; return 0; }
#define COPY_ASYNC(name, dst_t, src_t) \
    API CUresult name(dst_t dst, src_t src, size_t n, CUstream s) \
    { (void)dst; (void)src; (void)s; fake_cuda_bytes += n; return 0; }

COPY(cuMemcpyHtoD_v2, CUdeviceptr, const void *)
COPY(cuMemcpyDtoH_v2, void *, CUdeviceptr)
COPY(cuMemcpyDtoD_v2, CUdeviceptr, CUdeviceptr)
COPY(cuMemcpyHtoD_v2_ptds, CUdeviceptr, const void *)
COPY(cuMemcpyDtoH_v2_ptds, void *, CUdeviceptr)
COPY(cuMemcpyDtoD_v2_ptds, CUdeviceptr, CUdeviceptr)
COPY_ASYNC(cuMemcpyHtoDAsync_v2, CUdeviceptr, const void *)
COPY_ASYNC(cuMemcpyDtoHAsync_v2, void *, CUdeviceptr)
COPY_ASYNC(cuMemcpyDtoDAsync_v2, CUdeviceptr, CUdeviceptr)
COPY_ASYNC(cuMemcpyHtoDAsync_v2_ptsz, CUdeviceptr, const void *)
COPY_ASYNC(cuMemcpyDtoHAsync_v2_ptsz, void *, CUdeviceptr)
COPY_ASYNC(cuMemcpyDtoDAsync_v2_ptsz, CUdeviceptr, CUdeviceptr)

API CUresult cuCtxSynchronize(void)
{
    sleep_ns(2000000);
    return 0;
}

static CUresult stream_sync(CUstream s)
{
    if (s == FAKE_STREAM_HANG) {
        __sync_fetch_and_add(&fake_hung, 1);
        for (;;)
            pause();
    }
    sleep_ns(1000000);
    return 0;
}

API CUresult cuStreamSynchronize(CUstream s) { return stream_sync(s); }
API CUresult cuStreamSynchronize_ptsz(CUstream s) { return stream_sync(s); }
