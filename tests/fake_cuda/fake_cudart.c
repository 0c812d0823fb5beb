// SPDX-License-Identifier: Apache-2.0
/* fake_cudart.c — A TEST FAKE of NVIDIA's runtime library libcudart.so.12. It drives no GPU and must never be
 * installed.
 *
 * Compiled by tests/test_cuda.py as libcudart.so.12 (soname included). It exports the REAL runtime symbol names with
 * the real argument order (cuda_runtime_api.h, CUDA 12) and, like the real runtime, does its work by calling the
 * driver: it dlopen()s libcuda.so.1 and calls the driver's exported functions through pointers from dlsym (the real
 * runtime gets them from cuGetProcAddress). So a runtime call also runs the driver function beneath it, which is what
 * the probe must not count twice:
 *   cudaLaunchKernel[_ptsz] → cuLaunchKernel[_ptsz]    cudaLaunchKernelExC[_ptsz] → cuLaunchKernelEx[_ptsz]
 *   cudaMemcpy[_ptds](kind 1/2/3) → cuMemcpy{HtoD,DtoH,DtoD}_v2[_ptds]; kinds 0 and 4 (host to host, default) touch
 *   no hooked driver function      cudaMemcpyAsync[_ptsz] → the Async_v2[_ptsz] variants
 *   cudaDeviceSynchronize → cuCtxSynchronize (2 ms)    cudaStreamSynchronize[_ptsz] → cuStreamSynchronize[_ptsz]
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include "fake_types.h"

#define API __attribute__((visibility("default"), noinline))

static void *driver(const char *name)
{
    static void *lib;
    if (!lib && !(lib = dlopen("libcuda.so.1", RTLD_NOW))) {
        fprintf(stderr, "fake_cudart: %s\n", dlerror());
        abort();
    }
    void *fn = dlsym(lib, name);
    if (!fn) {
        fprintf(stderr, "fake_cudart: no %s in libcuda.so.1\n", name);
        abort();
    }
    return fn;
}

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*copy_fn)(unsigned long long, unsigned long long, size_t);
typedef CUresult (*copy_async_fn)(unsigned long long, unsigned long long, size_t, CUstream);
typedef CUresult (*sync_fn)(void);
typedef CUresult (*stream_sync_fn)(CUstream);

static cudaError_t launch(const char *drv, const void *func, dim3 g, dim3 b, void **args, size_t shared,
                          cudaStream_t s)
{
    return ((launch_fn)driver(drv))((CUfunction)func, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)shared, s, args, 0);
}

API cudaError_t cudaLaunchKernel(const void *func, dim3 g, dim3 b, void **args, size_t shared, cudaStream_t s)
{
    return launch("cuLaunchKernel", func, g, b, args, shared, s);
}

API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 g, dim3 b, void **args, size_t shared, cudaStream_t s)
{
    return launch("cuLaunchKernel_ptsz", func, g, b, args, shared, s);
}

API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args)
{
    return ((launch_ex_fn)driver("cuLaunchKernelEx"))((const CUlaunchConfig *)config, (CUfunction)func, args, 0);
}

API cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t *config, const void *func, void **args)
{
    return ((launch_ex_fn)driver("cuLaunchKernelEx_ptsz"))((const CUlaunchConfig *)config, (CUfunction)func, args,
                                                           0);
}

static const char *const COPIES[2][4] = {
    {0, "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2"},
    {0, "cuMemcpyHtoD_v2_ptds", "cuMemcpyDtoH_v2_ptds", "cuMemcpyDtoD_v2_ptds"},
};
static const char *const ASYNC_COPIES[2][4] = {
    {0, "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2"},
    {0, "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz", "cuMemcpyDtoDAsync_v2_ptsz"},
};

static cudaError_t copy(int ptds, void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    if (kind < 1 || kind > 3)
        return 0;   /* host to host, or "default" resolved from the pointers: no hooked driver call here */
    return ((copy_fn)driver(COPIES[ptds][kind]))((unsigned long long)dst, (unsigned long long)src, n);
}

static cudaError_t copy_async(int ptsz, void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                              cudaStream_t s)
{
    if (kind < 1 || kind > 3)
        return 0;
    return ((copy_async_fn)driver(ASYNC_COPIES[ptsz][kind]))((unsigned long long)dst, (unsigned long long)src, n,
                                                              s);
}

API cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    return copy(0, dst, src, n, kind);
}

API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
    return copy(1, dst, src, n, kind);
}

API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s)
{
    return copy_async(0, dst, src, n, kind, s);
}

API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                                     cudaStream_t s)
{
    return copy_async(1, dst, src, n, kind, s);
}

API cudaError_t cudaDeviceSynchronize(void)
{
    return ((sync_fn)driver("cuCtxSynchronize"))();
}

API cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    return ((stream_sync_fn)driver("cuStreamSynchronize"))(s);
}

API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s)
{
    return ((stream_sync_fn)driver("cuStreamSynchronize_ptsz"))(s);
}
