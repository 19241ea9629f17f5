/*
 * greyhound hook: what the interposition files share.
 *
 * Every interposed function follows one shape:
 *
 *     real = gh_resolve(&cache, "name");        // dlsym(RTLD_NEXT), cached
 *     if (!gh_enter()) return real(...);        // off, nested or initialising
 *     gh_gate_call();                           // number it, pause gate (bounded wait)
 *     t0 = gh_now_ns(); rc = real(...); t1 = gh_now_ns();
 *     gh_record(...); gh_leave(); return rc;
 *
 * so the program's call always happens exactly once with its own arguments and
 * its own return value, whatever state the hook is in. GH_INTERPOSE (below)
 * is that shape, written once for every family of calls.
 */
#ifndef GH_HOOK_H
#define GH_HOOK_H

#include <stdint.h>
#include <time.h>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include "gh_ring.h"

#define GH_EXPORT __attribute__((visibility("default")))
#define GH_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GH_LIKELY(x) __builtin_expect(!!(x), 1)

/* Problems reported at most once each (bit numbers). */
enum gh_problem {
	GH_P_NO_RUN_DIR,
	GH_P_BAD_ENV,
	GH_P_RING_OPEN,
	GH_P_RESOLVE,
	GH_P_COMM_TABLE,
	GH_P_CUDA,
	GH_P_FORK,
	GH_P_RANK,
	GH_P_MPI_ABI,
	GH_P_NCCL_ABI,
	GH_P_COUNT
};

/* Logging: one line on stderr, "greyhound: hook: ...", once per problem. */
void gh_log_once(enum gh_problem problem, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* CLOCK_MONOTONIC through clock_gettime (vDSO): 45-70 ns in a VM. */
static inline uint64_t gh_mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * The clock of the records (clock.c): CLOCK_MONOTONIC ns, read from the TSC
 * where that is safe. Parameters behind a sequence counter; refresh_ticks 0
 * sends every reading to gh_clock_slow (not calibrated yet, or no TSC).
 */
enum gh_clock_mode { GH_CLOCK_SYSTEM = 0, GH_CLOCK_TSC = 1 };

struct gh_clock {
	uint32_t seq;            /* odd while parameters change */
	uint32_t mode;           /* enum gh_clock_mode */
	uint64_t tsc0;           /* anchor tick ... */
	uint64_t ns0;            /* ... and its CLOCK_MONOTONIC ns */
	uint64_t mult;           /* ns per tick, times 2^32 */
	uint64_t refresh_ticks;  /* refit when tsc - tsc0 exceeds this */
};

extern struct gh_clock gh_clock;
/* Last reading of this thread: readings never go back within a thread. */
extern __thread uint64_t gh_last_ns __attribute__((tls_model("initial-exec")));

/* allow_tsc 0: GREYHOUND_CLOCK=monotonic. Returns 1 if the TSC will be used. */
int gh_clock_init(int allow_tsc);
uint64_t gh_clock_slow(void);
void gh_clock_atfork_child(void);

static inline uint64_t gh_now_ns(void)
{
	uint64_t ns;
#if defined(__x86_64__)
	/*
	 * Plain rdtsc, not lfence+rdtsc: it may run a few dozen cycles early or
	 * late relative to the call it brackets, far below anything the
	 * analytics resolve, and the fence would cost as much as it saves.
	 */
	uint32_t s = __atomic_load_n(&gh_clock.seq, __ATOMIC_ACQUIRE);
	uint64_t tsc = __rdtsc();
	uint64_t tsc0 = __atomic_load_n(&gh_clock.tsc0, __ATOMIC_RELAXED);
	uint64_t ns0 = __atomic_load_n(&gh_clock.ns0, __ATOMIC_RELAXED);
	uint64_t mult = __atomic_load_n(&gh_clock.mult, __ATOMIC_RELAXED);
	uint64_t refresh = __atomic_load_n(&gh_clock.refresh_ticks, __ATOMIC_RELAXED);
	uint64_t d = tsc - tsc0;

	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	if (GH_UNLIKELY(d > refresh || (s & 1) ||
			s != __atomic_load_n(&gh_clock.seq, __ATOMIC_RELAXED)))
		ns = gh_clock_slow();
	else
		ns = ns0 + (uint64_t)(((unsigned __int128)d * mult) >> 32);
#else
	ns = gh_mono_ns();
#endif
	if (GH_UNLIKELY(ns < gh_last_ns))
		ns = gh_last_ns;
	gh_last_ns = ns;
	return ns;
}

/* State of the hook in this process. */
enum gh_state { GH_UNINIT = 0, GH_INITIALISING = 1, GH_ON = 2, GH_OFF = 3 };

extern int gh_state_cached;          /* plain copy of the state for the fast check */
extern __thread int gh_nesting __attribute__((tls_model("initial-exec")));
extern struct gh_ring_header *gh_hdr; /* NULL unless GH_ON */

/*
 * Where the hook writes in the mapping comes from these process-private copies,
 * made when it created the ring: the header's copies of the same numbers are for
 * readers, and any process of the user can scribble on them. Only counters and
 * the gate are read back from the header, and none of them indexes anything
 * unchecked.
 */
extern struct gh_record *gh_records;
extern uint64_t gh_mask;                  /* records - 1 (a power of two) */
extern struct gh_comm_entry *gh_comm_table;
extern uint32_t gh_comm_capacity;
extern int gh_trace;                      /* GREYHOUND_TRACE=on: device timing of NCCL ops */

int gh_init_slow(void);

/*
 * Returns 1 if this call is to be recorded: the hook is on and this thread is
 * not already inside an intercepted call. A caller that got 1 must call
 * gh_leave(). The first call of the process initialises (opens the ring).
 */
static inline int gh_enter(void)
{
	int s = __atomic_load_n(&gh_state_cached, __ATOMIC_ACQUIRE);

	if (GH_UNLIKELY(s != GH_ON)) {
		if (s != GH_UNINIT || !gh_init_slow())
			return 0;
	}
	if (gh_nesting)
		return 0;
	gh_nesting = 1;
	return 1;
}

static inline void gh_leave(void)
{
	gh_nesting = 0;
}

/*
 * Whether a library whose calls the hook interposes (MPI, NCCL) has the ABI the
 * hook was built for: checked once, at the first call of that family, before
 * anything is recorded. Until it is known good (while another thread checks, or
 * for ever if it is foreign) the family's calls pass straight through. A check
 * returns 0 if the ABI is known, else -1 after one line saying why.
 */
enum gh_abi { GH_ABI_UNCHECKED = 0, GH_ABI_CHECKING = 1, GH_ABI_OK = 2, GH_ABI_FOREIGN = 3 };

int gh_abi_check_slow(int *state, int (*check)(void));

static inline int gh_abi_ok(int *state, int (*check)(void))
{
	if (GH_LIKELY(__atomic_load_n(state, __ATOMIC_ACQUIRE) == GH_ABI_OK))
		return 1;
	return gh_abi_check_slow(state, check);
}

/* call: the number of a communication call (gh_gate_call), 0 for any other call. */
void gh_gate_slow(uint64_t call);
/* Whether the gate holds the call numbered call (0: not a communication call) now. */
int gh_gate_holds(uint64_t call);

/*
 * The pause gate of a call that is not a communication call (Wait, GroupStart):
 * one relaxed load unless the agent has set it. It is held only by a pause of
 * the next call (gate_at_call 0); see gh_ring.h.
 */
static inline void gh_gate(void)
{
	if (GH_UNLIKELY(__atomic_load_n(&gh_hdr->gate, __ATOMIC_RELAXED) != 0))
		gh_gate_slow(0);
}

/*
 * The pause gate of a communication call (an op of ring.py's CALL_OPS), before
 * the call is made: numbers it (one relaxed increment of the ring's call
 * counter, on the cache line of head, which the record's claim writes anyway)
 * and returns its number. Only calls that will be recorded come here, so that
 * the k-th call record of a thread that calls one call at a time is number k.
 */
static inline uint64_t gh_gate_call(void)
{
	uint64_t call = __atomic_add_fetch(&gh_hdr->calls, 1, __ATOMIC_RELAXED);

	if (GH_UNLIKELY(__atomic_load_n(&gh_hdr->gate, __ATOMIC_RELAXED) != 0))
		gh_gate_slow(call);
	return call;
}

/* Appends one record; returns its sequence number (index + 1). Lock-free. */
static inline uint64_t gh_record(uint16_t op, uint8_t source, uint32_t flags,
				 uint64_t t_start_ns, uint64_t t_end_ns,
				 uint64_t size_bytes, uint64_t comm_id,
				 int32_t peer, uint64_t req_id, int32_t rc)
{
	struct gh_ring_header *hdr = gh_hdr;
	uint64_t idx = __atomic_fetch_add(&hdr->head, 1, __ATOMIC_RELAXED);
	struct gh_record *r = &gh_records[idx & gh_mask];

	if (GH_UNLIKELY(idx > gh_mask)) {
		uint64_t rpos = __atomic_load_n(&hdr->reader_pos, __ATOMIC_RELAXED);

		/* Slot idx - capacity is being overwritten: was it read? */
		if (idx - gh_mask - 1 >= rpos)
			__atomic_fetch_add(&hdr->drops, 1, __ATOMIC_RELAXED);
	}
	__atomic_store_n(&r->seq, 0, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	r->t_start_ns = t_start_ns;
	r->t_end_ns = t_end_ns;
	r->size_bytes = size_bytes;
	r->comm_id = comm_id;
	r->req_id = req_id;
	r->peer = peer;
	r->op = op;
	r->source = source;
	r->reserved0 = 0;
	r->flags = flags;
	r->rc = rc;
	__atomic_store_n(&r->seq, idx + 1, __ATOMIC_RELEASE);
	/* The next slot was last written a whole ring ago: fetch its line now, not then. */
	__builtin_prefetch(&gh_records[(idx + 1) & gh_mask], 1, 3);
	return idx + 1;
}

/* Communicator table in the ring file (slow path: creation only). */
void gh_comm_publish(uint64_t comm_id, uint64_t parent_id, int32_t size,
		     int32_t rank, uint16_t source, int32_t color);
void gh_comm_retire(uint64_t comm_id);

/*
 * Process-local map from a library's communicator handle (a pointer or an
 * integer) to what the hook knows about it. Lock-free open addressing; a
 * lookup is a few loads.
 */
struct gh_comm_info {
	uint64_t comm_id;
	int32_t size;
	int32_t rank;
	uint32_t flags;   /* GH_F_LOCAL_COMM when the id is process-local */
	uint32_t num_splits;
};

/*
 * The communicator a thread used last, so that a loop of calls on one
 * communicator skips the hash lookup. gh_comm_gen changes with every insert
 * and removal, which invalidates every thread's entry at once.
 */
struct gh_comm_last {
	uint64_t handle;
	uint64_t gen;
	uint32_t source;
	uint32_t valid;
	struct gh_comm_info info;
};

extern uint64_t gh_comm_gen;
extern __thread struct gh_comm_last gh_comm_last __attribute__((tls_model("initial-exec")));

int gh_comm_lookup_slow(uint8_t source, uint64_t handle, struct gh_comm_info *out);

static inline int gh_comm_lookup(uint8_t source, uint64_t handle, struct gh_comm_info *out)
{
	const struct gh_comm_last *c = &gh_comm_last;

	if (GH_LIKELY(c->valid && c->handle == handle && c->source == source &&
		      c->gen == __atomic_load_n(&gh_comm_gen, __ATOMIC_ACQUIRE))) {
		*out = c->info;
		return 1;
	}
	return gh_comm_lookup_slow(source, handle, out);
}
void gh_comm_insert(uint8_t source, uint64_t handle, const struct gh_comm_info *info);
void gh_comm_remove(uint8_t source, uint64_t handle);
/*
 * A call that destroys a communicator (MPI_Comm_free, ncclCommDestroy,
 * ncclCommAbort). gh_comm_end_begin, before the call, looks the handle up (after
 * it the library may give the handle to another communicator). gh_comm_end_done,
 * after it, if the hook knew the communicator and `destroyed` says the call
 * destroyed it: forgets the handle, retires the id in the ring's table and
 * records GH_OP_COMM_DESTROY with the call's rc.
 */
struct gh_comm_end {
	uint64_t handle;
	uint8_t source;
	int known;
	struct gh_comm_info info;
};

static inline void gh_comm_end_begin(struct gh_comm_end *e, uint8_t source, uint64_t handle)
{
	e->handle = handle;
	e->source = source;
	e->known = gh_comm_lookup(source, handle, &e->info);
}
void gh_comm_end_done(const struct gh_comm_end *e, int destroyed, int32_t rc);
/* Counts earlier communicators of the same members (to tell duplicates apart). */
uint32_t gh_comm_ordinal(uint8_t source, uint64_t member_hash);
uint32_t gh_comm_next_split(uint8_t source, uint64_t handle);

/* FNV-1a 64; greyhound/capture uses the same function for torch groups. */
#define GH_FNV_OFFSET 0xcbf29ce484222325ull
#define GH_FNV_PRIME 0x100000001b3ull
static inline uint64_t gh_fnv1a(uint64_t h, const void *data, unsigned long len)
{
	const unsigned char *p = data;

	for (unsigned long i = 0; i < len; i++) {
		h ^= p[i];
		h *= GH_FNV_PRIME;
	}
	return h;
}

/* Feeds one int32 as 4 little-endian bytes. */
static inline uint64_t gh_fnv1a_i32(uint64_t h, int32_t v)
{
	uint32_t u = (uint32_t)v;
	unsigned char b[4] = { u & 0xff, (u >> 8) & 0xff, (u >> 16) & 0xff, u >> 24 };

	return gh_fnv1a(h, b, 4);
}

/*
 * The real function behind an interposed name: dlsym(RTLD_NEXT), else the
 * first loaded object other than this one that defines it (a library opened
 * with RTLD_LOCAL, as Python extension modules are). Cached; NULL if none.
 */
void *gh_resolve_slow(void **cache, const char *name);
static inline void *gh_resolve(void **cache, const char *name)
{
	void *p = __atomic_load_n(cache, __ATOMIC_ACQUIRE);

	if (GH_LIKELY(p != NULL))
		return p;
	return gh_resolve_slow(cache, name);
}

/*
 * GH_REAL(fn): the real fn (gh_resolve), typed as the library's header declares
 * fn; NULL if no loaded object defines it. Each use has its own cache.
 */
#define GH_REAL(fn) ({							\
	static void *gh_real_cache_;					\
	(__typeof__(&fn))gh_resolve(&gh_real_cache_, #fn);		\
})

/*
 * The body of an interposed function, the shape at the top of this file:
 *
 *   fn       the function; its real one is GH_REAL(fn)
 *   args     its arguments, in parentheses, passed on unchanged
 *   missing  what it returns when no loaded object defines fn
 *   enter    whether to record the call: the family's gh_enter() (gh_leave()
 *            follows); the call passes straight through when it is 0
 *   begin    statements before the call (the gate, the start time)
 *   end      statements after it (the end time, the record), which see the
 *            call's result as rc
 *
 * The real function is called exactly once and its result returned.
 */
#define GH_INTERPOSE(fn, args, missing, enter, begin, end)		\
	do {								\
		__typeof__(&fn) real = GH_REAL(fn);			\
		__typeof__(fn args) rc;					\
									\
		if (GH_UNLIKELY(!real))					\
			return (missing);				\
		if (!(enter))						\
			return real args;				\
		begin;							\
		rc = real args;						\
		end;							\
		gh_leave();						\
		return rc;						\
	} while (0)
/* Same search for a symbol the hook only calls (e.g. PMPI_Comm_size). */
void *gh_lookup_loaded(const char *name);

/* NCCL device timing (nccl.c) and the Python capture's state (pyapi.c) are told about fork. */
void gh_nccl_atfork_child(void);
void gh_py_atfork_child(void);

#endif
