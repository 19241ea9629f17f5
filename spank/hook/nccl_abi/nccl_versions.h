/*
 * The NCCL releases whose ABI the hook knows, as ncclGetVersion codes; the hook
 * checks the library in the process against them at the first NCCL call and
 * lets every NCCL call through unrecorded outside them. Kept apart from the
 * vendored nccl.h because builds against a real nccl.h (NCCL_INCLUDE) use it
 * too.
 *
 * What the hook relies on: the prototypes of the calls it interposes, the
 * 128-byte ncclUniqueId, the ncclDataType_t and ncclResult_t values of
 * nccl_abi/nccl.h, NCCL_SPLIT_NOCOLOR. ncclCommSplit and ncclInProgress are
 * there from 2.18 on; libnccl.so.2 has kept them unchanged since (checked
 * against 2.21.5's nccl.h and NVIDIA/nccl's src/nccl.h.in of 2.2x, which also
 * adds the two FP8 types 10 and 11 that dtype_bytes knows). A new major version
 * may change any of it.
 */
#ifndef GH_NCCL_VERSIONS_H
#define GH_NCCL_VERSIONS_H

#define GH_NCCL_ABI_MIN_VERSION 21800   /* 2.18.0 */
#define GH_NCCL_ABI_MAX_VERSION 29999   /* the last 2.x */

#endif
