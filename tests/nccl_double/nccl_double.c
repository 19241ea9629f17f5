/*
 * A test double of libnccl.so.2 for machines without a GPU (tests only).
 *
 * Same ABI as NCCL 2.21 (spank/hook/nccl_abi/nccl.h) and the same call order a
 * program uses; one-rank communicators only, on host memory, executed
 * synchronously: a collective over one rank is a copy, and p2p to oneself
 * inside ncclGroupStart/End is matched at the outermost ncclGroupEnd.
 *
 * NCCL_DOUBLE_VERSION=CODE makes ncclGetVersion say CODE (an NCCL the hook may
 * not know), and NCCL_DOUBLE_VERSION=error makes it fail.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <nccl.h>

struct ncclComm {
	int nranks, rank;
	ncclUniqueId id;
};

struct pending {
	int is_send;
	void *buf;
	size_t bytes;
};

static int group_depth;
static struct pending pending[64];
static int num_pending;

static size_t dtype_size(ncclDataType_t t)
{
	static const size_t size[] = { 1, 1, 4, 4, 8, 8, 2, 4, 8, 2 };

	return (unsigned)t < sizeof(size) / sizeof(size[0]) ? size[t] : 0;
}

ncclResult_t ncclGetVersion(int *version)
{
	const char *v = getenv("NCCL_DOUBLE_VERSION");

	if (v && strcmp(v, "error") == 0)
		return ncclInternalError;
	*version = v ? atoi(v) : NCCL_VERSION_CODE;
	return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
	return getrandom(id->internal, sizeof(id->internal), 0) == sizeof(id->internal)
		       ? ncclSuccess : ncclSystemError;
}

const char *ncclGetErrorString(ncclResult_t r)
{
	return r == ncclSuccess ? "no error" : "nccl double: error";
}

static ncclResult_t make(ncclComm_t *comm, int nranks, int rank, const ncclUniqueId *id)
{
	struct ncclComm *c;

	if (!comm || nranks != 1 || rank != 0)
		return ncclInvalidArgument;
	c = calloc(1, sizeof(*c));
	if (!c)
		return ncclSystemError;
	c->nranks = nranks;
	c->rank = rank;
	if (id)
		c->id = *id;
	*comm = c;
	return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
	return make(comm, nranks, rank, &commId);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
				    int rank, ncclConfig_t *config)
{
	(void)config;
	return make(comm, nranks, rank, &commId);
}

ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
				      ncclUniqueId *commIds, ncclConfig_t *config)
{
	(void)config;
	if (nId < 1 || !commIds)
		return ncclInvalidArgument;
	return make(newcomm, nranks, myrank, &commIds[0]);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
			   ncclConfig_t *config)
{
	(void)key;
	(void)config;
	if (!comm || !newcomm)
		return ncclInvalidArgument;
	if (color == NCCL_SPLIT_NOCOLOR) {
		*newcomm = NULL;
		return ncclSuccess;
	}
	return make(newcomm, 1, 0, NULL);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
	return comm ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
	free(comm);
	return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
	free(comm);
	return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
	if (!comm || !count)
		return ncclInvalidArgument;
	*count = comm->nranks;
	return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
	if (!comm || !rank)
		return ncclInvalidArgument;
	*rank = comm->rank;
	return ncclSuccess;
}

static ncclResult_t copy(const void *src, void *dst, size_t count, ncclDataType_t t,
			 ncclComm_t comm)
{
	if (!comm || !dtype_size(t))
		return ncclInvalidArgument;
	if (src != dst && count)
		memmove(dst, src, count * dtype_size(t));
	return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			   cudaStream_t stream)
{
	(void)op;
	(void)stream;
	return copy(sendbuff, recvbuff, count, datatype, comm);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
			       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
			       cudaStream_t stream)
{
	(void)op;
	(void)stream;
	return copy(sendbuff, recvbuff, recvcount, datatype, comm);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
			   ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
	(void)stream;
	return copy(sendbuff, recvbuff, sendcount, datatype, comm);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
			   ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
	(void)stream;
	if (root != 0)
		return ncclInvalidArgument;
	return copy(sendbuff, recvbuff, count, datatype, comm);
}

ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
		       ncclComm_t comm, cudaStream_t stream)
{
	return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
			ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
			cudaStream_t stream)
{
	(void)op;
	(void)stream;
	if (root != 0)
		return ncclInvalidArgument;
	return copy(sendbuff, recvbuff, count, datatype, comm);
}

static ncclResult_t p2p(int is_send, void *buf, size_t count, ncclDataType_t t, int peer,
			ncclComm_t comm)
{
	if (!comm || peer != 0 || !dtype_size(t))
		return ncclInvalidArgument;
	if (group_depth == 0 || num_pending == 64)
		return ncclInvalidUsage; /* self p2p outside a group would deadlock in NCCL */
	pending[num_pending++] = (struct pending){ is_send, buf, count * dtype_size(t) };
	return ncclSuccess;
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	(void)stream;
	return p2p(1, (void *)sendbuff, count, datatype, peer, comm);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
		      ncclComm_t comm, cudaStream_t stream)
{
	(void)stream;
	return p2p(0, recvbuff, count, datatype, peer, comm);
}

ncclResult_t ncclGroupStart(void)
{
	group_depth++;
	return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
	int s = 0, r = 0;

	if (group_depth == 0)
		return ncclInvalidUsage;
	if (--group_depth > 0)
		return ncclSuccess;
	/* Match the i-th send with the i-th receive, as NCCL orders p2p per peer. */
	for (;;) {
		while (s < num_pending && !pending[s].is_send)
			s++;
		while (r < num_pending && pending[r].is_send)
			r++;
		if (s == num_pending || r == num_pending)
			break;
		if (pending[s].bytes != pending[r].bytes)
			return ncclInvalidUsage;
		memcpy(pending[r].buf, pending[s].buf, pending[s].bytes);
		s++;
		r++;
	}
	num_pending = 0;
	return ncclSuccess;
}
