/* SPDX-License-Identifier: Apache-2.0 */
/* fake_types.h — A TEST FAKE: the few public CUDA driver, runtime and NCCL types the fakes in this folder need,
 * declared by hand (no CUDA toolkit here) with the layouts and enum values of cuda.h, driver_types.h and nccl.h.
 * Nothing here drives a GPU; it must never be installed.
 */
#ifndef FAKE_TYPES_H
#define FAKE_TYPES_H
#include <stddef.h>

typedef int CUresult;                       /* enum cudaError_enum: CUDA_SUCCESS = 0 */
typedef unsigned long long CUdeviceptr;     /* CUdeviceptr_v2 */
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUlaunchConfig_st CUlaunchConfig;

typedef int cudaError_t;                    /* cudaSuccess = 0 */
typedef struct CUstream_st *cudaStream_t;
typedef struct cudaLaunchConfig_st cudaLaunchConfig_t;
typedef struct { unsigned int x, y, z; } dim3;   /* 12 bytes, passed by value in two registers */
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };

typedef int ncclResult_t;                   /* ncclSuccess = 0 */
typedef struct ncclComm *ncclComm_t;
typedef int ncclRedOp_t;
typedef int ncclDataType_t;                 /* ncclInt8 0 … ncclBfloat16 9, ncclFloat8e4m3 10, ncclFloat8e5m2 11 */

/* A stream handle the fake driver treats as "never finishes": its synchronize blocks forever, so that a test can
 * hold threads inside a probed call and then kill them there. */
#define FAKE_STREAM_HANG ((CUstream)0xdead)
#endif
