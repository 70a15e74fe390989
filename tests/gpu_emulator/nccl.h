// The emulated GPU's NCCL: the subset of the NCCL 2.x API the project calls, with the real names and
// values, for the processes of one mpirun job on one node. The ranks meet in a POSIX shared-memory
// segment named by the unique id; collectives run on the emulated device as pollable stream
// operations that wait for their peers (nccl.cpp describes the protocol).
//
// What it checks: device pointers (ncclInvalidArgument, with ncclGetLastError's text), the config
// magic, ranks and counts, ranks that call different collectives at the same point (an asynchronous
// ncclInvalidUsage naming what each rank called), operations on a communicator whose nonblocking
// init is still in progress (ncclInvalidUsage), ncclGroupEnd without ncclGroupStart. Nonblocking
// communicators answer ncclInProgress at random so that callers' polling is exercised. A peer that
// died or stalls is never waited out: its collective stays pending, as on a real GPU. As since NCCL
// 2.22, ranks connect lazily on their first collective: until all have issued one, a nonblocking
// communicator answers ncclInProgress, and a blocking one waits inside the call.
#pragma once
#include <climits>
#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_VERSION_CODE 22809
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

typedef struct ncclComm* ncclComm_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,  // declared as in the real header; not supported here (ncclInvalidArgument)
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL

// The leading fields of the real ncclConfig_t. Only `blocking` is used (undefined means blocking);
// a config not set from NCCL_CONFIG_INITIALIZER is rejected, as the real library does.
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER                                                                              \
  {                                                                                                          \
    sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), NCCL_CONFIG_UNDEF_INT, \
        NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR,          \
        NCCL_CONFIG_UNDEF_INT                                                                                \
  }

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);

const char* ncclGetErrorString(ncclResult_t result);
// The text of the last error in this process ("" if none); comm is unused, as in real NCCL.
const char* ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
// NCCL 2.28's: count elements from sendbuff + j * count go to rank j; rank i's land at
// recvbuff + i * count.
ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          ncclComm_t comm, cudaStream_t stream);

ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();

namespace amp::emu {
// The calling thread's group depth (ncclGroupStart minus ncclGroupEnd): a test can prove that a
// call that failed inside a group was still followed by ncclGroupEnd.
int nccl_group_depth();
// Makes the next collective call (ncclAllReduce, ncclBroadcast, ncclAllGather, ncclAlltoAll) of this process
// fail with r, as a real one can fail inside a group.
void nccl_fail_next_call_for_testing(ncclResult_t r);
}  // namespace amp::emu
