/*
 * greyhound hook: NCCL interposition.
 *
 * NCCL calls only enqueue work on a CUDA stream, so a record's t_end is when
 * the call returned (GH_F_ASYNC). With GREYHOUND_TRACE=on the hook also
 * brackets each operation with two CUDA timing events on the caller's stream
 * and, when a later NCCL call finds them complete, writes a GH_OP_DONE record
 * whose t_end - t_start is the device time. Inside ncclGroupStart/End the
 * kernels are launched at the outermost ncclGroupEnd, so the closing events
 * are recorded there. The CUDA runtime is looked up among the loaded objects;
 * without one there is no device timing and nothing else changes.
 *
 * Communicator ids: FNV-1a over the ncclUniqueId (the same bytes on every
 * member); a split's id is FNV-1a over (parent id, colour, n-th split of the
 * parent), all of which the members agree on.
 *
 * The first NCCL call checks the library's version (ncclGetVersion) against
 * the releases whose ABI the hook knows (nccl_abi/nccl_versions.h); outside
 * them every NCCL call goes straight to the library, untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <nccl.h>

#include "hook.h"
#include "nccl_abi/nccl_versions.h"

static __thread int group_depth __attribute__((tls_model("initial-exec")));
static __thread uint64_t group_t0 __attribute__((tls_model("initial-exec")));
static __thread uint32_t group_ops __attribute__((tls_model("initial-exec")));

/* ---- the library's ABI ----------------------------------------------------- */

static const char *nccl_library_name(void *symbol)
{
	Dl_info where;

	if (symbol && dladdr(symbol, &where) && where.dli_fname && where.dli_fname[0])
		return where.dli_fname;
	return "the NCCL library";
}

/* 0 if the NCCL in this process is a release whose ABI the hook knows. */
static int nccl_abi_check(void)
{
	void *sym = gh_lookup_loaded("ncclGetVersion"); /* not interposed */
	ncclResult_t (*get_version)(int *) = (ncclResult_t (*)(int *))sym;
	int code = 0, major, minor, patch;

	if (!get_version || get_version(&code) != ncclSuccess) {
		gh_log_once(GH_P_NCCL_ABI, "%.200s does not say which NCCL it is (ncclGetVersion); NCCL calls pass through unrecorded",
			    nccl_library_name(sym));
		return -1;
	}
	if (code >= GH_NCCL_ABI_MIN_VERSION && code <= GH_NCCL_ABI_MAX_VERSION)
		return 0;
	/* NCCL_VERSION(): X*10000 + Y*100 + Z from 2.9 on, X*1000 + Y*100 + Z before. */
	if (code >= 10000) {
		major = code / 10000;
		minor = code / 100 % 100;
	} else {
		major = code / 1000;
		minor = code / 100 % 10;
	}
	patch = code % 100;
	gh_log_once(GH_P_NCCL_ABI, "NCCL %d.%d.%d (%.200s, version code %d) is not a release whose ABI the hook knows (%d.%d to %d.x); NCCL calls pass through unrecorded",
		    major, minor, patch, nccl_library_name(sym), code,
		    GH_NCCL_ABI_MIN_VERSION / 10000, GH_NCCL_ABI_MIN_VERSION / 100 % 100,
		    GH_NCCL_ABI_MAX_VERSION / 10000);
	return -1;
}

static int nccl_abi = GH_ABI_UNCHECKED;

/* gh_enter() for NCCL calls: also 0 while the library's version is not known good. */
static inline int nccl_enter(void)
{
	return gh_abi_ok(&nccl_abi, nccl_abi_check) && gh_enter();
}

static uint64_t dtype_bytes(ncclDataType_t t, size_t count)
{
	static const uint8_t size[] = { 1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1 };

	if ((unsigned)t >= sizeof(size))
		return 0;
	return (uint64_t)count * size[t];
}

/* ---- device timing (GREYHOUND_TRACE=on) ---------------------------------- */

typedef int (*event_create_fn)(void **event, unsigned int flags);
typedef int (*event_record_fn)(void *event, void *stream);
typedef int (*event_query_fn)(void *event);
typedef int (*event_elapsed_fn)(float *ms, void *start, void *end);
typedef int (*last_error_fn)(void);
typedef int (*is_capturing_fn)(void *stream, int *status);
typedef int (*capture_mode_fn)(int *mode);

/* The CUDA runtime's values (cuda_runtime_api.h), which the hook is built without. */
#define GH_CUDA_SUCCESS 0
#define GH_CUDA_CAPTURE_STATUS_NONE 0  /* cudaStreamCaptureStatusNone */
#define GH_CUDA_CAPTURE_MODE_RELAXED 2 /* cudaStreamCaptureModeRelaxed */

#define EV_SLOTS 256u          /* operations in flight with timing */
#define EV_GROUP_MAX 64u       /* operations of one group timed */
enum { EV_FREE = 0, EV_STARTED = 1, EV_PENDING = 2 };

struct ev_slot {
	void *start, *end;
	void *stream;
	uint64_t seq, t_start_ns, size_bytes, comm_id;
	uint16_t op;
	int32_t peer;
	uint32_t state;
};

static struct {
	int resolved;              /* the runtime's calls: 0 not looked up, 1 found, -1 missing */
	int ready;                 /* the events: 0 not made, 1 usable, -1 unavailable (or forked) */
	int busy;                  /* try-lock: a thread that finds it taken skips timing */
	event_create_fn create;
	event_record_fn record;
	event_query_fn query;
	event_elapsed_fn elapsed;
	last_error_fn peek_error;  /* cudaPeekAtLastError */
	last_error_fn get_error;   /* cudaGetLastError: returns and clears it */
	is_capturing_fn is_capturing;
	capture_mode_fn capture_mode;
	uint64_t head, tail;       /* FIFO of slots, completed in stream order */
	struct ev_slot slot[EV_SLOTS];
} ev;

static __thread uint32_t group_slots[EV_GROUP_MAX] __attribute__((tls_model("initial-exec")));
static __thread uint32_t group_num_slots __attribute__((tls_model("initial-exec")));

static int ev_trylock(void)
{
	return __atomic_exchange_n(&ev.busy, 1, __ATOMIC_ACQUIRE) == 0;
}

static void ev_unlock(void)
{
	__atomic_store_n(&ev.busy, 0, __ATOMIC_RELEASE);
}

/* Looks the runtime's calls up once; 0 if one is missing (no device timing then). */
static int ev_resolve(void)
{
	if (ev.resolved)
		return ev.resolved > 0;
	ev.resolved = -1;
	ev.create = (event_create_fn)gh_lookup_loaded("cudaEventCreateWithFlags");
	ev.record = (event_record_fn)gh_lookup_loaded("cudaEventRecord");
	ev.query = (event_query_fn)gh_lookup_loaded("cudaEventQuery");
	ev.elapsed = (event_elapsed_fn)gh_lookup_loaded("cudaEventElapsedTime");
	ev.peek_error = (last_error_fn)gh_lookup_loaded("cudaPeekAtLastError");
	ev.get_error = (last_error_fn)gh_lookup_loaded("cudaGetLastError");
	ev.is_capturing = (is_capturing_fn)gh_lookup_loaded("cudaStreamIsCapturing");
	ev.capture_mode = (capture_mode_fn)gh_lookup_loaded("cudaThreadExchangeStreamCaptureMode");
	if (!ev.create || !ev.record || !ev.query || !ev.elapsed || !ev.peek_error ||
	    !ev.get_error || !ev.is_capturing || !ev.capture_mode) {
		gh_log_once(GH_P_CUDA, "GREYHOUND_TRACE=on but no CUDA runtime (10.1 or later) is loaded; NCCL ops are not device-timed");
		return 0;
	}
	ev.resolved = 1;
	return 1;
}

/*
 * The hook's own CUDA calls leave the program's CUDA state as they found it.
 * - An error they return becomes the thread's last error, which the program's
 *   next check raises (PyTorch checks cudaGetLastError after each kernel
 *   launch; a cudaEventQuery of unfinished work returns cudaErrorNotReady). So
 *   they run only while no error is pending, and what they leave is cleared.
 * - A "potentially unsafe" call such as cudaEventQuery, made while a stream
 *   capture in the global mode is under way in any thread, invalidates that
 *   capture (a CUDA graph). So they run in the relaxed capture mode, and never
 *   on a stream that is capturing (ev_begin).
 * Returns 0 (touch nothing) when the program has an error pending.
 */
struct cuda_quiet {
	int mode;                  /* the thread's capture mode, given back at the end */
};

static int cuda_quiet_begin(struct cuda_quiet *q)
{
	if (ev.peek_error() != GH_CUDA_SUCCESS)
		return 0;  /* the program's own error (or a sticky one): leave it to the program */
	q->mode = GH_CUDA_CAPTURE_MODE_RELAXED;
	if (ev.capture_mode(&q->mode) != GH_CUDA_SUCCESS) {
		(void)ev.get_error();
		return 0;
	}
	return 1;
}

static void cuda_quiet_end(struct cuda_quiet *q)
{
	(void)ev.capture_mode(&q->mode);
	if (ev.peek_error() != GH_CUDA_SUCCESS)
		(void)ev.get_error(); /* the hook's: none was pending before */
}

/* Makes the events, once; called with the try-lock held, inside cuda_quiet. */
static int ev_setup(void)
{
	if (ev.ready)
		return ev.ready > 0;
	ev.ready = -1;
	for (uint32_t i = 0; i < EV_SLOTS; i++) {
		if (ev.create(&ev.slot[i].start, 0) != 0 || ev.create(&ev.slot[i].end, 0) != 0) {
			gh_log_once(GH_P_CUDA, "cudaEventCreateWithFlags failed; NCCL ops are not device-timed");
			return 0; /* events already made are kept: a one-off, bounded cost */
		}
	}
	ev.ready = 1;
	return 1;
}

/* Writes DONE records for operations whose closing event has completed. */
static void ev_poll_locked(void)
{
	while (ev.head != ev.tail) {
		struct ev_slot *s = &ev.slot[ev.head % EV_SLOTS];
		float ms = 0;

		if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == EV_STARTED)
			break;      /* its call or group is not finished yet */
		if (ev.query(s->end) != 0)
			break;      /* not done (or an error: retried next time) */
		if (s->seq && ev.elapsed(&ms, s->start, s->end) == 0 && ms >= 0)
			gh_record(GH_OP_DONE, GH_SRC_NCCL, GH_F_DEVICE_TIMED, s->t_start_ns,
				  s->t_start_ns + (uint64_t)((double)ms * 1e6), s->size_bytes,
				  s->comm_id, s->peer, s->seq, 0);
		s->state = EV_FREE;
		ev.head++;
	}
}

/* Records the opening event; returns the slot or -1 (no timing for this op). */
static int ev_begin(void *stream)
{
	struct cuda_quiet q;
	int idx = -1, status = GH_CUDA_CAPTURE_STATUS_NONE;

	if (!gh_trace || !ev_trylock())
		return -1;
	if (ev.ready < 0 || !ev_resolve() || !cuda_quiet_begin(&q))
		goto out;
	if (!ev_setup())
		goto quiet;
	/*
	 * Work captured into a CUDA graph runs when the graph is launched: an
	 * event recorded here would be a node of the graph. Not timed; nor is an
	 * op on a stream whose capture status CUDA cannot say.
	 */
	if (ev.is_capturing(stream, &status) != GH_CUDA_SUCCESS ||
	    status != GH_CUDA_CAPTURE_STATUS_NONE)
		goto quiet;
	ev_poll_locked();
	if (ev.tail - ev.head >= EV_SLOTS ||
	    (group_depth > 0 && group_num_slots >= EV_GROUP_MAX)) {
		__atomic_fetch_add(&gh_hdr->events_skipped, 1, __ATOMIC_RELAXED);
		goto quiet;
	}
	idx = (int)(ev.tail % EV_SLOTS);
	if (ev.record(ev.slot[idx].start, stream) != 0) {
		idx = -1;
		goto quiet;
	}
	ev.slot[idx].state = EV_STARTED;
	ev.slot[idx].stream = stream;
	ev.tail++;
quiet:
	cuda_quiet_end(&q);
out:
	ev_unlock();
	return idx;
}

static void ev_close(struct ev_slot *s)
{
	struct cuda_quiet q;

	/* If the closing event cannot be recorded, the opening one alone is useless. */
	if (!cuda_quiet_begin(&q)) {
		s->seq = 0;
	} else {
		if (ev.record(s->end, s->stream) != 0)
			s->seq = 0;
		cuda_quiet_end(&q);
	}
	/* The slot is this thread's until it is marked pending. */
	__atomic_store_n(&s->state, EV_PENDING, __ATOMIC_RELEASE);
}

static void ev_end(int idx, uint64_t seq, uint64_t t_start_ns, uint64_t size_bytes,
		   uint64_t comm_id, uint16_t op, int32_t peer)
{
	struct ev_slot *s = &ev.slot[idx];

	s->seq = seq;
	s->t_start_ns = t_start_ns;
	s->size_bytes = size_bytes;
	s->comm_id = comm_id;
	s->op = op;
	s->peer = peer;
	if (group_depth > 0) {
		group_slots[group_num_slots++] = (uint32_t)idx;
		return; /* closed at the outermost ncclGroupEnd */
	}
	ev_close(s);
}

static void ev_group_end(void)
{
	for (uint32_t i = 0; i < group_num_slots; i++)
		ev_close(&ev.slot[group_slots[i]]);
	group_num_slots = 0;
}

void gh_nccl_atfork_child(void)
{
	/* CUDA does not survive fork: the child never times device work. */
	ev.ready = -1;
	ev.busy = 0;
	group_depth = 0;
	group_num_slots = 0;
}

/* ---- communicators -------------------------------------------------------- */

static inline uint64_t handle_of(ncclComm_t comm)
{
	return (uint64_t)(uintptr_t)comm;
}

/* The communicator's size and this rank in it; -1 where NCCL cannot say. */
static void comm_size_rank(ncclComm_t comm, int *size, int *rank)
{
	__typeof__(&ncclCommCount) count = GH_REAL(ncclCommCount);
	__typeof__(&ncclCommUserRank) user_rank = GH_REAL(ncclCommUserRank);

	if (!count || count(comm, size) != ncclSuccess)
		*size = -1;
	if (!user_rank || user_rank(comm, rank) != ncclSuccess)
		*rank = -1;
}

static void comm_info(ncclComm_t comm, struct gh_comm_info *ci)
{
	if (GH_LIKELY(gh_comm_lookup(GH_SRC_NCCL, handle_of(comm), ci)))
		return;
	/* Made by a call the hook does not wrap: the id is only process-local. */
	memset(ci, 0, sizeof(*ci));
	comm_size_rank(comm, &ci->size, &ci->rank);
	ci->comm_id = gh_fnv1a(GH_FNV_OFFSET, &comm, sizeof(comm));
	ci->flags = GH_F_LOCAL_COMM;
	gh_comm_insert(GH_SRC_NCCL, handle_of(comm), ci);
	gh_comm_publish(ci->comm_id, 0, ci->size, ci->rank, GH_SRC_NCCL, -1);
}

/* A count per rank times the communicator's size (1 if NCCL could not say it). */
static size_t all_ranks(ncclComm_t comm, size_t count)
{
	struct gh_comm_info ci;

	comm_info(comm, &ci);
	return count * (size_t)(ci.size > 0 ? ci.size : 1);
}

static void comm_created(ncclComm_t comm, uint64_t comm_id, uint64_t parent_id, int size,
			 int rank, int color, uint16_t op, uint64_t t0, ncclResult_t rc)
{
	struct gh_comm_info ci = { .comm_id = comm_id, .size = size, .rank = rank };

	gh_comm_insert(GH_SRC_NCCL, handle_of(comm), &ci);
	gh_comm_publish(comm_id, parent_id, size, rank, GH_SRC_NCCL, color);
	gh_record(op, GH_SRC_NCCL, rc == ncclInProgress ? GH_F_ASYNC : 0, t0, gh_now_ns(),
		  (uint64_t)size, comm_id, rank, parent_id, rc);
}

/* ---- the common shape of an operation ------------------------------------- */

struct call {
	uint64_t t0;
	int ev;
};

static inline void op_begin(struct call *c, void *stream)
{
	gh_gate_call();
	c->ev = ev_begin(stream);
	c->t0 = gh_now_ns();
}

static inline void op_end(struct call *c, uint16_t op, ncclComm_t comm, uint64_t bytes,
			  int32_t peer, ncclResult_t rc)
{
	uint64_t t1 = gh_now_ns(), seq;
	uint32_t flags = GH_F_ASYNC;
	struct gh_comm_info ci;

	comm_info(comm, &ci);
	if (group_depth > 0) {
		flags |= GH_F_GROUPED;
		group_ops++;
	}
	if (rc != ncclSuccess && rc != ncclInProgress)
		flags |= GH_F_ERROR;
	seq = gh_record(op, GH_SRC_NCCL, flags | ci.flags, c->t0, t1, bytes, ci.comm_id, peer,
			0, rc);
	if (c->ev >= 0)
		ev_end(c->ev, flags & GH_F_ERROR ? 0 : seq, c->t0, bytes, ci.comm_id, op, peer);
}

/* The body of an NCCL call (GH_INTERPOSE); `end` sees the result as rc. */
#define NCCL_CALL(fn, args, begin, end) \
	GH_INTERPOSE(fn, args, ncclInternalError, nccl_enter(), begin, end)

/*
 * The body of an operation enqueued on stream: gated, timed (and device-timed),
 * then `record`: statements that see the result as rc and the call as c.
 */
#define NCCL_OP(fn, args, stream, record) \
	struct call c;                    \
	NCCL_CALL(fn, args, op_begin(&c, stream), record)

/* ---- communicator lifetime ------------------------------------------------ */

/* After a call that made *comm, whose id is FNV-1a over the id_len bytes of id. */
static void comm_init_end(ncclComm_t *comm, const void *id, unsigned long id_len, int nranks,
			  int rank, uint64_t t0, ncclResult_t rc)
{
	if ((rc == ncclSuccess || rc == ncclInProgress) && comm && id && id_len > 0)
		comm_created(*comm, gh_fnv1a(GH_FNV_OFFSET, id, id_len), 0, nranks, rank, -1,
			     GH_OP_COMM_INIT, t0, rc);
}

GH_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId,
					int rank)
{
	uint64_t t0;

	NCCL_CALL(ncclCommInitRank, (comm, nranks, commId, rank), t0 = gh_now_ns(),
		  comm_init_end(comm, &commId, sizeof(commId), nranks, rank, t0, rc));
}

GH_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
					      int rank, ncclConfig_t *config)
{
	uint64_t t0;

	NCCL_CALL(ncclCommInitRankConfig, (comm, nranks, commId, rank, config), t0 = gh_now_ns(),
		  comm_init_end(comm, &commId, sizeof(commId), nranks, rank, t0, rc));
}

GH_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank,
						int nId, ncclUniqueId *commIds,
						ncclConfig_t *config)
{
	uint64_t t0;

	/* An NCCL older than 2.23 has no such call: ncclInvalidUsage. */
	GH_INTERPOSE(ncclCommInitRankScalable, (newcomm, nranks, myrank, nId, commIds, config),
		     ncclInvalidUsage, nccl_enter(), t0 = gh_now_ns(),
		     comm_init_end(newcomm, commIds,
				   nId > 0 ? (unsigned long)nId * sizeof(*commIds) : 0, nranks,
				   myrank, t0, rc));
}

/* A split: its parent, and the n-th split of the parent this is. */
struct split {
	struct gh_comm_info parent;
	uint32_t nth;
	uint64_t t0;
};

static void split_begin(struct split *s, ncclComm_t comm)
{
	comm_info(comm, &s->parent);
	/* Every member of the parent calls split, so all agree on this count. */
	s->nth = gh_comm_next_split(GH_SRC_NCCL, handle_of(comm));
	s->t0 = gh_now_ns();
}

static void split_end(const struct split *s, int color, ncclComm_t *newcomm, ncclResult_t rc)
{
	uint64_t id;
	int size = -1, rank = -1;

	if ((rc != ncclSuccess && rc != ncclInProgress) || !newcomm || !*newcomm ||
	    color == NCCL_SPLIT_NOCOLOR)
		return;
	comm_size_rank(*newcomm, &size, &rank);
	id = gh_fnv1a(GH_FNV_OFFSET, &s->parent.comm_id, sizeof(s->parent.comm_id));
	id = gh_fnv1a_i32(gh_fnv1a_i32(id, color), (int32_t)s->nth);
	comm_created(*newcomm, id, s->parent.comm_id, size, rank, color, GH_OP_COMM_SPLIT, s->t0,
		     rc);
}

GH_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
				     ncclConfig_t *config)
{
	struct split s;

	NCCL_CALL(ncclCommSplit, (comm, color, key, newcomm, config), split_begin(&s, comm),
		  split_end(&s, color, newcomm, rc));
}

/* Destroy and abort: the communicator is gone, whatever the result. */
GH_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
	struct gh_comm_end e;

	NCCL_CALL(ncclCommDestroy, (comm), gh_comm_end_begin(&e, GH_SRC_NCCL, handle_of(comm)),
		  gh_comm_end_done(&e, 1, rc));
}

GH_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm)
{
	struct gh_comm_end e;

	NCCL_CALL(ncclCommAbort, (comm), gh_comm_end_begin(&e, GH_SRC_NCCL, handle_of(comm)),
		  gh_comm_end_done(&e, 1, rc));
}

/* ---- groups --------------------------------------------------------------- */

static void group_begin(void)
{
	gh_gate();
	if (group_depth++ == 0) {
		group_t0 = gh_now_ns();
		group_ops = 0;
		group_num_slots = 0;
	}
}

static void group_end(ncclResult_t rc)
{
	if (group_depth <= 0 || --group_depth > 0)
		return;
	/* The kernels were launched just now: close their timing events. */
	ev_group_end();
	gh_record(GH_OP_GROUP, GH_SRC_NCCL,
		  (rc != ncclSuccess && rc != ncclInProgress) ? GH_F_ERROR : 0, group_t0,
		  gh_now_ns(), group_ops, 0, -1, 0, rc);
}

GH_EXPORT ncclResult_t ncclGroupStart(void)
{
	NCCL_CALL(ncclGroupStart, (), group_begin(), (void)0);
}

GH_EXPORT ncclResult_t ncclGroupEnd(void)
{
	NCCL_CALL(ncclGroupEnd, (), (void)0, group_end(rc));
}

/* ---- collectives and point to point --------------------------------------- */

GH_EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
				     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
				     cudaStream_t stream)
{
	NCCL_OP(ncclAllReduce, (sendbuff, recvbuff, count, datatype, op, comm, stream), stream,
		op_end(&c, GH_OP_ALLREDUCE, comm, dtype_bytes(datatype, count), -1, rc));
}

/* Bytes reduced: the whole input, recvcount x ranks (as MPI's). */
GH_EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
					 ncclDataType_t datatype, ncclRedOp_t op,
					 ncclComm_t comm, cudaStream_t stream)
{
	NCCL_OP(ncclReduceScatter, (sendbuff, recvbuff, recvcount, datatype, op, comm, stream),
		stream, op_end(&c, GH_OP_REDUCESCATTER, comm,
			       dtype_bytes(datatype, all_ranks(comm, recvcount)), -1, rc));
}

/* Bytes gathered: the whole output, sendcount x ranks (as MPI's). */
GH_EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
				     ncclDataType_t datatype, ncclComm_t comm,
				     cudaStream_t stream)
{
	NCCL_OP(ncclAllGather, (sendbuff, recvbuff, sendcount, datatype, comm, stream), stream,
		op_end(&c, GH_OP_ALLGATHER, comm, dtype_bytes(datatype, all_ranks(comm, sendcount)),
		       -1, rc));
}

GH_EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
				     ncclDataType_t datatype, int root, ncclComm_t comm,
				     cudaStream_t stream)
{
	NCCL_OP(ncclBroadcast, (sendbuff, recvbuff, count, datatype, root, comm, stream), stream,
		op_end(&c, GH_OP_BROADCAST, comm, dtype_bytes(datatype, count), root, rc));
}

GH_EXPORT ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root,
				 ncclComm_t comm, cudaStream_t stream)
{
	NCCL_OP(ncclBcast, (buff, count, datatype, root, comm, stream), stream,
		op_end(&c, GH_OP_BROADCAST, comm, dtype_bytes(datatype, count), root, rc));
}

GH_EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count,
				  ncclDataType_t datatype, ncclRedOp_t op, int root,
				  ncclComm_t comm, cudaStream_t stream)
{
	NCCL_OP(ncclReduce, (sendbuff, recvbuff, count, datatype, op, root, comm, stream), stream,
		op_end(&c, GH_OP_REDUCE, comm, dtype_bytes(datatype, count), root, rc));
}

GH_EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
				int peer, ncclComm_t comm, cudaStream_t stream)
{
	NCCL_OP(ncclSend, (sendbuff, count, datatype, peer, comm, stream), stream,
		op_end(&c, GH_OP_SEND, comm, dtype_bytes(datatype, count), peer, rc));
}

GH_EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
				ncclComm_t comm, cudaStream_t stream)
{
	NCCL_OP(ncclRecv, (recvbuff, count, datatype, peer, comm, stream), stream,
		op_end(&c, GH_OP_RECV, comm, dtype_bytes(datatype, count), peer, rc));
}
