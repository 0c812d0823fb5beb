// SPDX-License-Identifier: Apache-2.0
/* fake_nccl.c — A TEST FAKE of NVIDIA's collective library libnccl.so.2. It moves no data and must never be
 * installed.
 *
 * Compiled by tests/test_cuda.py as libnccl.so.2 (soname included). It exports the REAL NCCL symbol names with the
 * real argument order (nccl.h, NCCL 2.2x), and, like NCCL's NCCL_API macro, also the profiling names pncclX as
 * aliases of the same functions (one address: a probe must attach once per address, not once per name). Each
 * collective launches one kernel through the driver's exported cuLaunchKernel (real NCCL launches its kernels through
 * the driver too) and then spends FAKE_NCCL_NS inside the call, so that time in the call has a known lower bound.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "fake_types.h"

#define FAKE_NCCL_NS 200000L

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

static ncclResult_t collective(cudaStream_t s)
{
    static launch_fn launch;
    if (!launch) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (!lib || !(launch = (launch_fn)dlsym(lib, "cuLaunchKernel"))) {
            fprintf(stderr, "fake_nccl: %s\n", dlerror());
            abort();
        }
    }
    launch(0, 1, 1, 1, 32, 1, 1, 0, s, 0, 0);
    struct timespec ts = {0, FAKE_NCCL_NS};
    while (nanosleep(&ts, &ts) != 0) {
    }
    return 0;
}

/* The real NCCL_API macro: pncclX is an alias of X (same address), both exported. */
#define NCCL_API(ret, func, ...) \
    __attribute__((visibility("default"), alias(#func))) ret p##func(__VA_ARGS__); \
    __attribute__((visibility("default"), noinline)) ret func(__VA_ARGS__)

NCCL_API(ncclResult_t, ncclAllReduce, const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)datatype; (void)op; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclAllGather, const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
         ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)sendcount; (void)datatype; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclReduceScatter, const void *sendbuff, void *recvbuff, size_t recvcount,
         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)recvcount; (void)datatype; (void)op; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclBroadcast, const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)datatype; (void)root; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclReduce, const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)recvbuff; (void)count; (void)datatype; (void)op; (void)root; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclSend, const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
         ncclComm_t comm, cudaStream_t stream)
{
    (void)sendbuff; (void)count; (void)datatype; (void)peer; (void)comm;
    return collective(stream);
}

NCCL_API(ncclResult_t, ncclRecv, void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
         cudaStream_t stream)
{
    (void)recvbuff; (void)count; (void)datatype; (void)peer; (void)comm;
    return collective(stream);
}
