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

#define DECLARE_REAL(fn) static void *real_##fn
#define REAL(fn) ((__typeof__(&fn))gh_resolve(&real_##fn, #fn))

#define WAIT_TRACKED 64 /* requests of one Waitall/Waitsome recorded one by one */

DECLARE_REAL(PMPI_Comm_size);
DECLARE_REAL(PMPI_Comm_rank);
DECLARE_REAL(PMPI_Comm_group);
DECLARE_REAL(PMPI_Group_translate_ranks);
DECLARE_REAL(PMPI_Group_free);
DECLARE_REAL(PMPI_Type_size);
DECLARE_REAL(PMPI_Type_get_envelope);

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
	__typeof__(&PMPI_Comm_group) comm_group = REAL(PMPI_Comm_group);
	__typeof__(&PMPI_Group_translate_ranks) translate = REAL(PMPI_Group_translate_ranks);
	__typeof__(&PMPI_Group_free) group_free = REAL(PMPI_Group_free);
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

	comm_size = REAL(PMPI_Comm_size);
	comm_rank = REAL(PMPI_Comm_rank);
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
	__typeof__(&PMPI_Type_size) type_size = REAL(PMPI_Type_size);
	__typeof__(&PMPI_Type_get_envelope) envelope = REAL(PMPI_Type_get_envelope);
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

/* ---- collectives ---------------------------------------------------------- */

DECLARE_REAL(MPI_Allreduce);
GH_EXPORT int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count,
			    MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	__typeof__(&MPI_Allreduce) real = REAL(MPI_Allreduce);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, recvbuf, count, datatype, op, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, recvbuf, count, datatype, op, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_ALLREDUCE, sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0, t0, t1,
	    type_bytes(datatype, count), &ci, -1, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Reduce_scatter);
GH_EXPORT int MPI_Reduce_scatter(const void *sendbuf, void *recvbuf, const int recvcounts[],
				 MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	__typeof__(&MPI_Reduce_scatter) real = REAL(MPI_Reduce_scatter);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	long total = 0;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, recvbuf, recvcounts, datatype, op, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, recvbuf, recvcounts, datatype, op, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	/* Bytes reduced: the whole input (sum of the pieces). */
	for (int i = 0; recvcounts && i < ci.size; i++)
		total += recvcounts[i];
	rec(GH_OP_REDUCESCATTER, sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0, t0, t1,
	    type_bytes(datatype, total), &ci, -1, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Reduce_scatter_block);
GH_EXPORT int MPI_Reduce_scatter_block(const void *sendbuf, void *recvbuf, int recvcount,
				       MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
	__typeof__(&MPI_Reduce_scatter_block) real = REAL(MPI_Reduce_scatter_block);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, recvbuf, recvcount, datatype, op, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, recvbuf, recvcount, datatype, op, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_REDUCESCATTER, sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0, t0, t1,
	    type_bytes(datatype, (long)recvcount * (ci.size > 0 ? ci.size : 1)), &ci, -1, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Allgather);
GH_EXPORT int MPI_Allgather(const void *sendbuf, int sendcount, MPI_Datatype sendtype,
			    void *recvbuf, int recvcount, MPI_Datatype recvtype, MPI_Comm comm)
{
	__typeof__(&MPI_Allgather) real = REAL(MPI_Allgather);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	/* Bytes gathered: the whole output (the send side may be MPI_IN_PLACE). */
	rec(GH_OP_ALLGATHER, sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0, t0, t1,
	    type_bytes(recvtype, (long)recvcount * (ci.size > 0 ? ci.size : 1)), &ci, -1, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Bcast);
GH_EXPORT int MPI_Bcast(void *buffer, int count, MPI_Datatype datatype, int root,
			MPI_Comm comm)
{
	__typeof__(&MPI_Bcast) real = REAL(MPI_Bcast);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(buffer, count, datatype, root, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(buffer, count, datatype, root, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_BROADCAST, 0, t0, t1, type_bytes(datatype, count), &ci, root, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Reduce);
GH_EXPORT int MPI_Reduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
			 MPI_Op op, int root, MPI_Comm comm)
{
	__typeof__(&MPI_Reduce) real = REAL(MPI_Reduce);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, recvbuf, count, datatype, op, root, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, recvbuf, count, datatype, op, root, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_REDUCE, sendbuf == MPI_IN_PLACE ? GH_F_IN_PLACE : 0, t0, t1,
	    type_bytes(datatype, count), &ci, root, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Barrier);
GH_EXPORT int MPI_Barrier(MPI_Comm comm)
{
	__typeof__(&MPI_Barrier) real = REAL(MPI_Barrier);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_BARRIER, 0, t0, t1, 0, &ci, -1, 0, rc);
	gh_leave();
	return rc;
}

/* ---- point to point ------------------------------------------------------- */

DECLARE_REAL(MPI_Send);
GH_EXPORT int MPI_Send(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
		       MPI_Comm comm)
{
	__typeof__(&MPI_Send) real = REAL(MPI_Send);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(buf, count, datatype, dest, tag, comm);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(buf, count, datatype, dest, tag, comm);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_SEND, 0, t0, t1, type_bytes(datatype, count), &ci, dest, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Recv);
GH_EXPORT int MPI_Recv(void *buf, int count, MPI_Datatype datatype, int source, int tag,
		       MPI_Comm comm, MPI_Status *status)
{
	__typeof__(&MPI_Recv) real = REAL(MPI_Recv);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(buf, count, datatype, source, tag, comm, status);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(buf, count, datatype, source, tag, comm, status);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	if (source == MPI_ANY_SOURCE && status != MPI_STATUS_IGNORE && rc == MPI_SUCCESS)
		source = status->MPI_SOURCE;
	rec(GH_OP_RECV, 0, t0, t1, type_bytes(datatype, count), &ci, source, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Sendrecv);
GH_EXPORT int MPI_Sendrecv(const void *sendbuf, int sendcount, MPI_Datatype sendtype, int dest,
			   int sendtag, void *recvbuf, int recvcount, MPI_Datatype recvtype,
			   int source, int recvtag, MPI_Comm comm, MPI_Status *status)
{
	__typeof__(&MPI_Sendrecv) real = REAL(MPI_Sendrecv);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(sendbuf, sendcount, sendtype, dest, sendtag, recvbuf, recvcount,
			    recvtype, source, recvtag, comm, status);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(sendbuf, sendcount, sendtype, dest, sendtag, recvbuf, recvcount, recvtype,
		  source, recvtag, comm, status);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	/* One record: bytes sent, peer = destination (the receive side is symmetric). */
	rec(GH_OP_SENDRECV, 0, t0, t1, type_bytes(sendtype, sendcount), &ci, dest, 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Isend);
GH_EXPORT int MPI_Isend(const void *buf, int count, MPI_Datatype datatype, int dest, int tag,
			MPI_Comm comm, MPI_Request *request)
{
	__typeof__(&MPI_Isend) real = REAL(MPI_Isend);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(buf, count, datatype, dest, tag, comm, request);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(buf, count, datatype, dest, tag, comm, request);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_SEND, GH_F_ASYNC, t0, t1, type_bytes(datatype, count), &ci, dest,
	    request ? (uint64_t)(uintptr_t)*request : 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Irecv);
GH_EXPORT int MPI_Irecv(void *buf, int count, MPI_Datatype datatype, int source, int tag,
			MPI_Comm comm, MPI_Request *request)
{
	__typeof__(&MPI_Irecv) real = REAL(MPI_Irecv);
	struct gh_comm_info ci;
	uint64_t t0, t1;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(buf, count, datatype, source, tag, comm, request);
	gh_gate_call();
	t0 = gh_now_ns();
	rc = real(buf, count, datatype, source, tag, comm, request);
	t1 = gh_now_ns();
	comm_info(comm, &ci);
	rec(GH_OP_RECV, GH_F_ASYNC, t0, t1, type_bytes(datatype, count), &ci, source,
	    request ? (uint64_t)(uintptr_t)*request : 0, rc);
	gh_leave();
	return rc;
}

/* ---- completion ----------------------------------------------------------- */

static const struct gh_comm_info no_comm = { .comm_id = 0, .size = -1, .rank = -1 };

DECLARE_REAL(MPI_Wait);
GH_EXPORT int MPI_Wait(MPI_Request *request, MPI_Status *status)
{
	__typeof__(&MPI_Wait) real = REAL(MPI_Wait);
	uint64_t t0, t1, req;
	int rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(request, status);
	gh_gate();
	req = request ? (uint64_t)(uintptr_t)*request : 0; /* the call resets it */
	t0 = gh_now_ns();
	rc = real(request, status);
	t1 = gh_now_ns();
	rec(GH_OP_WAIT, 0, t0, t1, 0, &no_comm, -1, req, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Waitall);
GH_EXPORT int MPI_Waitall(int count, MPI_Request array_of_requests[],
			  MPI_Status array_of_statuses[])
{
	__typeof__(&MPI_Waitall) real = REAL(MPI_Waitall);
	uint64_t t0, t1, reqs[WAIT_TRACKED];
	int n, rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(count, array_of_requests, array_of_statuses);
	gh_gate();
	n = count <= WAIT_TRACKED && array_of_requests ? count : 0;
	for (int i = 0; i < n; i++)
		reqs[i] = (uint64_t)(uintptr_t)array_of_requests[i];
	t0 = gh_now_ns();
	rc = real(count, array_of_requests, array_of_statuses);
	t1 = gh_now_ns();
	if (n == 0 && count > 0) /* too many to list: one record for all */
		rec(GH_OP_WAIT, 0, t0, t1, 0, &no_comm, -1, 0, rc);
	for (int i = 0; i < n; i++)
		rec(GH_OP_WAIT, 0, t0, t1, 0, &no_comm, -1, reqs[i], rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Waitany);
GH_EXPORT int MPI_Waitany(int count, MPI_Request array_of_requests[], int *index,
			  MPI_Status *status)
{
	__typeof__(&MPI_Waitany) real = REAL(MPI_Waitany);
	uint64_t t0, t1, reqs[WAIT_TRACKED];
	int n, rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(count, array_of_requests, index, status);
	gh_gate();
	n = count <= WAIT_TRACKED && array_of_requests ? count : 0;
	for (int i = 0; i < n; i++)
		reqs[i] = (uint64_t)(uintptr_t)array_of_requests[i];
	t0 = gh_now_ns();
	rc = real(count, array_of_requests, index, status);
	t1 = gh_now_ns();
	rec(GH_OP_WAIT, 0, t0, t1, 0, &no_comm, -1,
	    index && *index >= 0 && *index < n ? reqs[*index] : 0, rc);
	gh_leave();
	return rc;
}

DECLARE_REAL(MPI_Waitsome);
GH_EXPORT int MPI_Waitsome(int incount, MPI_Request array_of_requests[], int *outcount,
			   int array_of_indices[], MPI_Status array_of_statuses[])
{
	__typeof__(&MPI_Waitsome) real = REAL(MPI_Waitsome);
	uint64_t t0, t1, reqs[WAIT_TRACKED];
	int n, rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!mpi_enter())
		return real(incount, array_of_requests, outcount, array_of_indices,
			    array_of_statuses);
	gh_gate();
	n = incount <= WAIT_TRACKED && array_of_requests ? incount : 0;
	for (int i = 0; i < n; i++)
		reqs[i] = (uint64_t)(uintptr_t)array_of_requests[i];
	t0 = gh_now_ns();
	rc = real(incount, array_of_requests, outcount, array_of_indices, array_of_statuses);
	t1 = gh_now_ns();
	if (outcount && array_of_indices && *outcount != MPI_UNDEFINED) {
		for (int k = 0; k < *outcount; k++) {
			int i = array_of_indices[k];

			rec(GH_OP_WAIT, 0, t0, t1, 0, &no_comm, -1, i >= 0 && i < n ? reqs[i] : 0, rc);
		}
	}
	gh_leave();
	return rc;
}

/* ---- communicator lifetime ------------------------------------------------ */

DECLARE_REAL(MPI_Comm_free);
GH_EXPORT int MPI_Comm_free(MPI_Comm *comm)
{
	__typeof__(&MPI_Comm_free) real = REAL(MPI_Comm_free);
	struct gh_comm_info ci;
	uint64_t handle, now;
	int known, rc;

	if (GH_UNLIKELY(!real))
		return MPI_ERR_INTERN;
	if (!comm || !mpi_enter())
		return real(comm);
	handle = handle_of(*comm);
	known = gh_comm_lookup(GH_SRC_MPI, handle, &ci);
	rc = real(comm);
	if (known && rc == MPI_SUCCESS) {
		/* The handle may be reused for another communicator: forget it. */
		gh_comm_remove(GH_SRC_MPI, handle);
		gh_comm_retire(ci.comm_id);
		now = gh_now_ns(); /* one reading: start == end, never end < start */
		gh_record(GH_OP_COMM_DESTROY, GH_SRC_MPI, ci.flags, now, now, 0,
			  ci.comm_id, ci.rank, 0, rc);
	}
	gh_leave();
	return rc;
}
