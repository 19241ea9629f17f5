/*
 * greyhound hook: MPI interposition (the CPU twin of the NCCL path).
 *
 * The hook defines the MPI_* entry points and forwards each to the next
 * definition (dlsym(RTLD_NEXT), i.e. libmpi or another PMPI tool), so it links
 * without libmpi and loads into programs that have no MPI at all.
 *
 * Communicator ids are the same on every member without any communication:
 * FNV-1a over the members' MPI_COMM_WORLD ranks (in communicator rank order),
 * then over an ordinal that tells apart communicators with the same members
 * (MPI_COMM_WORLD and its duplicates), counted in order of first use.
 * greyhound/capture/sitecustomize.py derives torch group ids the same way.
 *
 * Built against Open MPI's mpi.h (handles are pointers); MPI_COMM_WORLD is
 * looked up at run time because its address lives in libmpi.
 *
 * The plugin preloads the hook into every job, whatever MPI it was built with,
 * and an MPICH-family library (MPICH, Intel MPI, MVAPICH, Cray MPICH) gives the
 * same bits other meanings: its handles are ints, its MPI_PROC_NULL (-1) is
 * Open MPI's MPI_ANY_SOURCE and its MPI_STATUS_IGNORE is (MPI_Status *)1. So
 * the first MPI call checks that the library is the one the hook was built for
 * (mpi_abi_check); until then, and for ever if it is not, every MPI_* call goes
 * straight to the library, untouched. After the check the cost is one load and
 * a branch per call.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "hook.h"

#ifdef OPEN_MPI
/*
 * The Open MPI releases whose libmpi.so.40 keeps the C ABI this file is compiled
 * against (3.0 to 5.0 share that soname); the values below are the ones the
 * code relies on, fixed by that ABI.
 */
#define OMPI_ABI_MIN_MAJOR 3
#define OMPI_ABI_MAX_MAJOR 5
_Static_assert(MPI_SUCCESS == 0 && MPI_ANY_SOURCE == -1 && MPI_UNDEFINED == -32766 &&
	       MPI_COMBINER_NAMED == 0, "Open MPI constants the hook assumes");
#endif

#define WAIT_TRACKED 64 /* requests of one Waitall/Waitsome recorded one by one */

static uint64_t handle_of(MPI_Comm comm)
{
	return (uint64_t)(uintptr_t)comm;
}

static MPI_Comm world_comm(void)
{
#ifdef OPEN_MPI
	static void *world;
	void *w = __atomic_load_n(&world, __ATOMIC_ACQUIRE);

	if (!w) {
		/*
		 * A data symbol: an executable linked to libmpi holds a copy of it
		 * (copy relocation) that libmpi itself uses, so search from the
		 * executable (RTLD_DEFAULT), not after the hook (RTLD_NEXT), which
		 * would find libmpi's unused original. Only a libmpi opened
		 * RTLD_LOCAL (no copy anywhere) is searched for by object.
		 */
		w = dlsym(RTLD_DEFAULT, "ompi_mpi_comm_world");
		if (!w)
			w = gh_lookup_loaded("ompi_mpi_comm_world");
		__atomic_store_n(&world, w, __ATOMIC_RELEASE);
	}
	return (MPI_Comm)w;
#else
	return MPI_COMM_WORLD;
#endif
}

/* The file that defines libmpi's MPI_Comm_size (not interposed), for messages. */
static const char *mpi_library_name(void)
{
	void *p = gh_lookup_loaded("MPI_Comm_size");
	Dl_info where;

	if (p && dladdr(p, &where) && where.dli_fname && where.dli_fname[0])
		return where.dli_fname;
	return "the MPI library";
}

/* 0 if the MPI library in this process has the ABI the hook was compiled for. */
static int mpi_abi_check(void)
{
#ifdef OPEN_MPI
	/* Static: the check runs once, in one thread (gh_abi_check_slow). */
	static char version[4096];
	int (*get_version)(char *, int *);
	int len = 0, major = -1;

	if (!world_comm()) {
		gh_log_once(GH_P_MPI_ABI, "%.200s is not Open MPI (no ompi_mpi_comm_world), and the hook is built for Open MPI's ABI; MPI calls pass through unrecorded",
			    mpi_library_name());
		return -1;
	}
	/*
	 * Open MPI's own word for its version (callable at any time, MPI-3). Only
	 * asked once the library is known to be Open MPI, whose version string fits
	 * in MPI_MAX_LIBRARY_VERSION_STRING (256) bytes, far below the buffer.
	 */
	get_version = (int (*)(char *, int *))gh_lookup_loaded("MPI_Get_library_version");
	if (!get_version || get_version(version, &len) != MPI_SUCCESS ||
	    sscanf(version, "Open MPI v%d.", &major) != 1) {
		gh_log_once(GH_P_MPI_ABI, "%.200s does not say which Open MPI it is (MPI_Get_library_version); MPI calls pass through unrecorded",
			    mpi_library_name());
		return -1;
	}
	if (major < OMPI_ABI_MIN_MAJOR || major > OMPI_ABI_MAX_MAJOR) {
		gh_log_once(GH_P_MPI_ABI, "Open MPI %d (%.200s) is not one whose ABI the hook knows (Open MPI %d to %d); MPI calls pass through unrecorded",
			    major, mpi_library_name(), OMPI_ABI_MIN_MAJOR, OMPI_ABI_MAX_MAJOR);
		return -1;
	}
	return 0;
#else
	/* Built against another MPI's mpi.h: Open MPI is the one library known not to match. */
	if (dlsym(RTLD_DEFAULT, "ompi_mpi_comm_world") || gh_lookup_loaded("ompi_mpi_comm_world")) {
		gh_log_once(GH_P_MPI_ABI, "%.200s is Open MPI, and the hook is built for another MPI's ABI; MPI calls pass through unrecorded",
			    mpi_library_name());
		return -1;
	}
	return 0;
#endif
}

static int mpi_abi = GH_ABI_UNCHECKED;

/* gh_enter() for MPI calls: also 0 while the library's ABI is not known to match. */
static inline int mpi_enter(void)
{
	return gh_abi_ok(&mpi_abi, mpi_abi_check) && gh_enter();
}

/* Member hash over world ranks; 0 if MPI cannot tell (then the id is local). */
static int member_hash(MPI_Comm comm, int size, uint64_t *hash)
{
	__typeof__(&PMPI_Comm_group) comm_group = GH_REAL(PMPI_Comm_group);
	__typeof__(&PMPI_Group_translate_ranks) translate = GH_REAL(PMPI_Group_translate_ranks);
	__typeof__(&PMPI_Group_free) group_free = GH_REAL(PMPI_Group_free);
	MPI_Comm world = world_comm();
	MPI_Group group, wgroup;
	int ranks[256], wranks[256];
	uint64_t h = GH_FNV_OFFSET;
	int rv = -1, have_group = 0, have_wgroup = 0;

	if (!comm_group || !translate || !group_free || !world)
		goto fail;
	if (comm_group(comm, &group) != MPI_SUCCESS)
		goto fail;
	have_group = 1;
	if (comm_group(world, &wgroup) != MPI_SUCCESS)
		goto fail;
	have_wgroup = 1;
	/* Fixed chunks: no allocation, whatever the communicator's size. */
	for (int base = 0; base < size; base += 256) {
		int n = size - base < 256 ? size - base : 256;

		for (int i = 0; i < n; i++)
			ranks[i] = base + i;
		if (translate(group, n, ranks, wgroup, wranks) != MPI_SUCCESS)
			goto fail;
		for (int i = 0; i < n; i++)
			h = gh_fnv1a_i32(h, wranks[i]);
	}
	*hash = h;
	rv = 0;
fail:
	if (have_group)
		group_free(&group);
	if (have_wgroup)
		group_free(&wgroup);
	return rv;
}

/* A communicator seen for the first time: derive its id and describe it. */
static __attribute__((noinline)) void comm_info_slow(MPI_Comm comm, struct gh_comm_info *ci)
{
	__typeof__(&PMPI_Comm_size) comm_size;
	__typeof__(&PMPI_Comm_rank) comm_rank;
	uint64_t hash, now;

	comm_size = GH_REAL(PMPI_Comm_size);
	comm_rank = GH_REAL(PMPI_Comm_rank);
	ci->size = -1;
	ci->rank = -1;
	ci->num_splits = 0;
	if (comm_size && comm_size(comm, &ci->size) != MPI_SUCCESS)
		ci->size = -1;
	if (comm_rank && comm_rank(comm, &ci->rank) != MPI_SUCCESS)
		ci->rank = -1;
	if (ci->size > 0 && member_hash(comm, ci->size, &hash) == 0) {
		ci->comm_id = gh_fnv1a_i32(hash, (int32_t)gh_comm_ordinal(GH_SRC_MPI, hash));
		ci->flags = 0;
	} else {
		ci->comm_id = gh_fnv1a(GH_FNV_OFFSET, &comm, sizeof(comm));
		ci->flags = GH_F_LOCAL_COMM;
	}
	gh_comm_insert(GH_SRC_MPI, handle_of(comm), ci);
	gh_comm_publish(ci->comm_id, 0, ci->size, ci->rank, GH_SRC_MPI, -1);
	now = gh_now_ns(); /* one reading: start == end, never end < start */
	gh_record(GH_OP_COMM_INIT, GH_SRC_MPI, ci->flags, now, now,
		  (uint64_t)(ci->size > 0 ? ci->size : 0), ci->comm_id, ci->rank, 0, 0);
}

/* What the hook knows about a communicator; derived once, then a lookup. */
static inline void comm_info(MPI_Comm comm, struct gh_comm_info *ci)
{
	if (GH_UNLIKELY(!gh_comm_lookup(GH_SRC_MPI, handle_of(comm), ci)))
		comm_info_slow(comm, ci);
}

/*
 * Sizes of predefined datatypes, which live as long as MPI does: a call into
 * libmpi per record costs more than the rest of the record. A slot is claimed
 * by CAS on `claim`, filled, then published by storing `key` (release); a
 * reader trusts a slot whose key is its datatype. Derived types may be freed
 * and their handles reused, so they are never cached.
 */
#define TYPE_SLOTS 64u /* power of two */
#define TYPE_PROBES 4u

static struct {
	uint64_t key;
	uint64_t claim;
	int size;
} type_cache[TYPE_SLOTS];

static inline uint32_t type_slot(uint64_t key)
{
	return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 58) & (TYPE_SLOTS - 1);
}

static int type_size_slow(MPI_Datatype type, uint64_t key)
{
	__typeof__(&PMPI_Type_size) type_size = GH_REAL(PMPI_Type_size);
	__typeof__(&PMPI_Type_get_envelope) envelope = GH_REAL(PMPI_Type_get_envelope);
	int size = 0, ni, na, nd, combiner;

	if (!type_size || type_size(type, &size) != MPI_SUCCESS || size < 0)
		return -1;
	if (key == 0 || !envelope || envelope(type, &ni, &na, &nd, &combiner) != MPI_SUCCESS ||
	    combiner != MPI_COMBINER_NAMED)
		return size;
	for (uint32_t n = 0, i = type_slot(key); n < TYPE_PROBES; n++, i = (i + 1) & (TYPE_SLOTS - 1)) {
		uint64_t free_ = 0;

		if (__atomic_load_n(&type_cache[i].key, __ATOMIC_ACQUIRE) == key)
			break;
		if (!__atomic_compare_exchange_n(&type_cache[i].claim, &free_, key, 0,
						 __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			continue;
		type_cache[i].size = size;
		__atomic_store_n(&type_cache[i].key, key, __ATOMIC_RELEASE);
		break;
	}
	return size;
}

static inline uint64_t type_bytes(MPI_Datatype type, long count)
{
	uint64_t key = (uint64_t)(uintptr_t)type;
	int size = -1;

	if (count <= 0)
		return 0;
	for (uint32_t n = 0, i = type_slot(key); n < TYPE_PROBES; n++, i = (i + 1) & (TYPE_SLOTS - 1)) {
		uint64_t k = __atomic_load_n(&type_cache[i].key, __ATOMIC_ACQUIRE);

		if (GH_LIKELY(k == key && key != 0)) {
			size = type_cache[i].size;
			break;
		}
		if (k == 0)
			break;
	}
	if (size < 0)
		size = type_size_slow(type, key);
	if (size < 0)
		return 0;
	return (uint64_t)count * (uint64_t)size;
}

static inline void rec(uint16_t op, uint32_t flags, uint64_t t0, uint64_t t1,
		       uint64_t bytes, const struct gh_comm_info *ci, int32_t peer,
		       uint64_t req, int rc)
{
	gh_record(op, GH_SRC_MPI, flags | ci->flags | (rc != MPI_SUCCESS ? GH_F_ERROR : 0),
		  t0, t1, bytes, ci->comm_id, peer, req, rc);
}

/* ---- the common shape of a communication call ----------------------------- */

/*
 * A recorded communication call between its two halves. Its communicator is
 * kept apart, behind ci: comm_info's slow path takes the address of what it
 * fills, which would keep t0 and t1 in memory too.
 */
struct call {
	uint64_t t0, t1;
	struct gh_comm_info *ci;  /* its communicator, from op_done on */
};

/* Before the call: the pause gate, which numbers it, then its start time. */
static inline void op_begin(struct call *c)
{
	gh_gate_call();
	c->t0 = gh_now_ns();
}

/* After it: its end time, then its communicator (derived at its first use, after t1). */
static inline void op_done(struct call *c, MPI_Comm comm)
{
	c->t1 = gh_now_ns();
	comm_info(comm, c->ci);
}

static inline void op_record(const struct call *c, uint16_t op, uint32_t flags, uint64_t bytes,
			     int32_t peer, uint64_t req, int rc)
{
	rec(op, flags, c->t0, c->t1, bytes, c->ci, peer, req, rc);
}

/*
 * The body of a communication call fn on comm (GH_INTERPOSE): gated and timed,
 * then `record`: statements that see the result as rc and the call as c, its
 * communicator in *c.ci.
 */
#define MPI_OP(fn, args, comm, record)						\
	struct gh_comm_info ci;							\
	struct call c = { .ci = &ci };						\
	GH_INTERPOSE(fn, args, MPI_ERR_INTERN, mpi_enter(), op_begin(&c),	\
		     op_done(&c, comm); record)

static inline uint32_t in_place(const void *sendbuf)
{
	return sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0;
}

/* A count per rank times the communicator's size (1 if MPI could not say it). */
static inline long all_ranks(const struct call *c, int count)
{
	return (long)count * (c->ci->size > 0 ? c->ci->size : 1);
}

/* A request's id in the records: its handle, as Isend/Irecv set it (Wait resets it). */
static inline uint64_t req_id(const MPI_Request *request)
{
	return request ? (uint64_t)(uintptr_t)*request : 0;
}

/* ---- collectives ---------------------------------------------------------- */

GH_EXPORT int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count,
			    MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	MPI_OP(MPI_Allreduce, (sendbuf, recvbuf, count, datatype, op, comm), comm,
	       op_record(&c, GH_OP_ALLREDUCE, in_place(sendbuf), type_bytes(datatype, count),
			 -1, 0, rc));
}

/* Bytes reduced by Reduce_scatter: the whole input (the sum of the pieces). */
static long sum_counts(const int counts[], int num_ranks)
{
	long total = 0;

	for (int i = 0; counts && i < num_ranks; i++)
		total += counts[i];
	return total;
}

GH_EXPORT int MPI_Reduce_scatter(const void *sendbuf, void *recvbuf, const int recvcounts[],
				 MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	MPI_OP(MPI_Reduce_scatter, (sendbuf, recvbuf, recvcounts, datatype, op, comm), comm,
	       op_record(&c, GH_OP_REDUCESCATTER, in_place(sendbuf),
			 type_bytes(datatype, sum_counts(recvcounts, c.ci->size)), -1, 0, rc));
}

GH_EXPORT int MPI_Reduce_scatter_block(const void *sendbuf, void *recvbuf, int recvcount,
				       MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	MPI_OP(MPI_Reduce_scatter_block, (sendbuf, recvbuf, recvcount, datatype, op, comm), comm,
	       op_record(&c, GH_OP_REDUCESCATTER, in_place(sendbuf),
			 type_bytes(datatype, all_ranks(&c, recvcount)), -1, 0, rc));
}

/* Bytes gathered: the whole output (the send side may be MPI_IN_PLACE). */
GH_EXPORT int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype,
			    void *recvbuf, int recvcount, MPI_Datatype recvtype, MPI_Comm comm)
{
	MPI_OP(MPI_Allgather, (sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm),
	       comm, op_record(&c, GH_OP_ALLGATHER, in_place(sendbuf),
			       type_bytes(recvtype, all_ranks(&c, recvcount)), -1, 0, rc));
}

GH_EXPORT int MPI_Bcast(void *buffer, int count, MPI_Datatype datatype, int root,
			MPI_Comm comm)
{
	MPI_OP(MPI_Bcast, (buffer, count, datatype, root, comm), comm,
	       op_record(&c, GH_OP_BROADCAST, 0, type_bytes(datatype, count), root, 0, rc));
}

GH_EXPORT int MPI_Reduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
			 MPI_Op op, int root, MPI_Comm comm)
{
	MPI_OP(MPI_Reduce, (sendbuf, recvbuf, count, datatype, op, root, comm), comm,
	       op_record(&c, GH_OP_REDUCE, in_place(sendbuf), type_bytes(datatype, count), root,
			 0, rc));
}

GH_EXPORT int MPI_Barrier(MPI_Comm comm)
{
	MPI_OP(MPI_Barrier, (comm), comm, op_record(&c, GH_OP_BARRIER, 0, 0, -1, 0, rc));
}

/* ---- point to point ------------------------------------------------------- */

GH_EXPORT int MPI_Send(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
		       MPI_Comm comm)
{
	MPI_OP(MPI_Send, (buf, count, datatype, dest, tag, comm), comm,
	       op_record(&c, GH_OP_SEND, 0, type_bytes(datatype, count), dest, 0, rc));
}

/* The peer of a receive: the sender MPI matched, when any source would do. */
static inline int32_t recv_peer(int source, const MPI_Status *status, int rc)
{
	if (source == MPI_ANY_SOURCE && status != MPI_STATUS_IGNORE && rc == MPI_SUCCESS)
		return status->MPI_SOURCE;
	return source;
}

GH_EXPORT int MPI_Recv(void *buf, int count, MPI_Datatype datatype, int source, int tag,
		       MPI_Comm comm, MPI_Status *status)
{
	MPI_OP(MPI_Recv, (buf, count, datatype, source, tag, comm, status), comm,
	       op_record(&c, GH_OP_RECV, 0, type_bytes(datatype, count),
			 recv_peer(source, status, rc), 0, rc));
}

/* One record: bytes sent, peer = destination (the receive side is symmetric). */
GH_EXPORT int MPI_Sendrecv(const void *sendbuf, int sendcount, MPI_Datatype sendtype, int dest,
			   int sendtag, void *recvbuf, int recvcount, MPI_Datatype recvtype,
			   int source, int recvtag, MPI_Comm comm, MPI_Status *status)
{
	MPI_OP(MPI_Sendrecv, (sendbuf, sendcount, sendtype, dest, sendtag, recvbuf, recvcount,
			      recvtype, source, recvtag, comm, status), comm,
	       op_record(&c, GH_OP_SENDRECV, 0, type_bytes(sendtype, sendcount), dest, 0, rc));
}

GH_EXPORT int MPI_Isend(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
			MPI_Comm comm, MPI_Request *request)
{
	MPI_OP(MPI_Isend, (buf, count, datatype, dest, tag, comm, request), comm,
	       op_record(&c, GH_OP_SEND, GH_F_ASYNC, type_bytes(datatype, count), dest,
			 req_id(request), rc));
}

GH_EXPORT int MPI_Irecv(void *buf, int count, MPI_Datatype datatype, int source, int tag,
			MPI_Comm comm, MPI_Request *request)
{
	MPI_OP(MPI_Irecv, (buf, count, datatype, source, tag, comm, request), comm,
	       op_record(&c, GH_OP_RECV, GH_F_ASYNC, type_bytes(datatype, count), source,
			 req_id(request), rc));
}

/* ---- completion ----------------------------------------------------------- */

static const struct gh_comm_info no_comm = { .comm_id = 0, .size = -1, .rank = -1 };

/* A completion call, with the requests it completes as they were before it. */
struct wait {
	uint64_t t0, t1;
	int n;                         /* requests listed: 0 when there are too many */
	uint64_t reqs[WAIT_TRACKED];
};

/* Before the call: the pause gate, the requests' ids, then its start time. */
static inline void wait_begin(struct wait *w, int count, const MPI_Request requests[])
{
	gh_gate();
	w->n = count <= WAIT_TRACKED && requests ? count : 0;
	for (int i = 0; i < w->n; i++)
		w->reqs[i] = (uint64_t)(uintptr_t)requests[i];
	w->t0 = gh_now_ns();
}

/* The id of the i-th request, 0 if it was not listed. */
static inline uint64_t wait_req(const struct wait *w, int i)
{
	return i >= 0 && i < w->n ? w->reqs[i] : 0;
}

static inline void wait_record(const struct wait *w, uint64_t req, int rc)
{
	rec(GH_OP_WAIT, 0, w->t0, w->t1, 0, &no_comm, -1, req, rc);
}

/*
 * The body of a completion call fn of count requests (GH_INTERPOSE): timed,
 * then `record`: statements that see the result as rc and the call as w.
 */
#define MPI_WAIT(fn, args, count, requests, record)				\
	struct wait w;								\
	GH_INTERPOSE(fn, args, MPI_ERR_INTERN, mpi_enter(),			\
		     wait_begin(&w, count, requests), w.t1 = gh_now_ns(); record)

GH_EXPORT int MPI_Wait(MPI_Request *request, MPI_Status *status)
{
	MPI_WAIT(MPI_Wait, (request, status), 1, request, wait_record(&w, wait_req(&w, 0), rc));
}

/* One record per request, or one for all when there are too many to list. */
static void waitall_record(const struct wait *w, int count, int rc)
{
	if (w->n == 0 && count > 0)
		wait_record(w, 0, rc);
	for (int i = 0; i < w->n; i++)
		wait_record(w, w->reqs[i], rc);
}

GH_EXPORT int MPI_Waitall(int count, MPI_Request array_of_requests[],
			  MPI_Status array_of_statuses[])
{
	MPI_WAIT(MPI_Waitall, (count, array_of_requests, array_of_statuses), count,
		 array_of_requests, waitall_record(&w, count, rc));
}

GH_EXPORT int MPI_Waitany(int count, MPI_Request array_of_requests[], int *index,
			  MPI_Status *status)
{
	MPI_WAIT(MPI_Waitany, (count, array_of_requests, index, status), count, array_of_requests,
		 wait_record(&w, index ? wait_req(&w, *index) : 0, rc));
}

/* One record per request completed. */
static void waitsome_record(const struct wait *w, const int *outcount, const int indices[],
			    int rc)
{
	if (!outcount || !indices || *outcount == MPI_UNDEFINED)
		return;
	for (int k = 0; k < *outcount; k++)
		wait_record(w, wait_req(w, indices[k]), rc);
}

GH_EXPORT int MPI_Waitsome(int incount, MPI_Request array_of_requests[], int *outcount,
			   int array_of_indices[], MPI_Status array_of_statuses[])
{
	MPI_WAIT(MPI_Waitsome, (incount, array_of_requests, outcount, array_of_indices,
				array_of_statuses), incount, array_of_requests,
		 waitsome_record(&w, outcount, array_of_indices, rc));
}

/* ---- communicator lifetime ------------------------------------------------ */

GH_EXPORT int MPI_Comm_free(MPI_Comm *comm)
{
	struct gh_comm_end e;

	GH_INTERPOSE(MPI_Comm_free, (comm), MPI_ERR_INTERN, comm && mpi_enter(),
		     gh_comm_end_begin(&e, GH_SRC_MPI, handle_of(*comm)),
		     gh_comm_end_done(&e, rc == MPI_SUCCESS, rc));
}
