/*
 * greyhound hook: the entry points the Python capture calls through ctypes.
 *
 * torch.distributed's gloo backend does its communication inside libtorch,
 * where no interposition can see it; greyhound/capture wraps the Python API
 * and writes the same records into the same ring through these functions.
 *
 * Per captured call the capture makes two argument-free calls, gh_py_begin
 * and gh_py_end, and packs the record into a per-thread staging area in
 * between: ctypes spends ~0.1 us on a call but ~0.3 us on each argument it
 * converts, and the budget for the whole capture is 2 us a call. The two
 * calls also take the record's times (the TSC clock is cheaper than Python's
 * time.monotonic_ns), so that after the wrapped call returns only gh_py_end
 * runs: code that runs right after a blocking torch call runs on cold caches,
 * several times slower than in a loop.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "hook.h"
#include "pyhead.h"

/* The thread's record in the making: the head the caller hands over, and the times. */
struct gh_py_stage {
	struct gh_py_head head;
	uint64_t t_start_ns;
	uint64_t t_end_ns;
};

/* This thread is inside a captured call (torch's nested calls are part of it). */
static __thread int py_busy __attribute__((tls_model("initial-exec")));
/* The number of the communication call this thread began, 0 if not one (gh_ring.h). */
static __thread uint64_t py_call __attribute__((tls_model("initial-exec")));
static __thread struct gh_py_stage py_stage __attribute__((tls_model("initial-exec")));

/* 1 if the hook records in this process (opens the ring on first use). */
GH_EXPORT int gh_py_active(void)
{
	if (!gh_enter())
		return __atomic_load_n(&gh_state_cached, __ATOMIC_ACQUIRE) == GH_ON;
	gh_leave();
	return 1;
}

/*
 * Address of this process's gate word, so the caller can test it with one
 * load before each operation (and call gh_py_gate only when it is set);
 * 0 when the hook is off. After fork the child must ask again.
 */
GH_EXPORT uintptr_t gh_py_gate_word(void)
{
	if (!gh_py_active())
		return 0;
	return (uintptr_t)&gh_hdr->gate;
}

/*
 * The pause gate, for the call this thread began (gh_py_begin_call: held by a
 * pause at its number; gh_py_begin: held only by a pause of the next call);
 * returns at once unless the agent has set it.
 */
GH_EXPORT void gh_py_gate(void)
{
	if (!gh_enter())
		return;
	if (GH_UNLIKELY(__atomic_load_n(&gh_hdr->gate, __ATOMIC_RELAXED) != 0))
		gh_gate_slow(py_busy ? py_call : 0);
	gh_leave();
	if (py_busy)
		py_stage.t_start_ns = gh_now_ns(); /* the call starts after the wait */
}

/* Appends one record from the capture; returns its seq, 0 when off. */
GH_EXPORT uint64_t gh_py_record(uint32_t op, uint64_t comm_id, int32_t peer,
				uint64_t size_bytes, uint64_t t_start_ns, uint64_t t_end_ns,
				uint32_t flags, uint64_t req_id)
{
	uint64_t seq;

	if (op >= GH_OP_COUNT || !gh_enter())
		return 0;
	seq = gh_record((uint16_t)op, GH_SRC_TORCH, flags, t_start_ns, t_end_ns, size_bytes,
			comm_id, peer, req_id, 0);
	gh_leave();
	return seq;
}

/*
 * Starts a captured call on this thread that writes no communication-call
 * record (a Wait; a call recorded nowhere). Returns 0 when it is not to be
 * recorded (the hook is off, or this thread is already inside one), else the
 * address of the thread's staging record, plus 1 when the pause gate holds it
 * (the caller then waits in gh_py_gate, which releases the GIL and takes the
 * start time again). A nonzero return must be matched by gh_py_end.
 *
 * The record starts empty (op 0: nothing is written unless the caller packs
 * op, flags, peer, comm_id and size_bytes), with t_start = now and req_id 0.
 */
static inline uintptr_t py_begin(uint32_t num_calls)
{
	uint64_t call = 0;
	int gate;

	if (py_busy || !gh_enter())
		return 0;
	/*
	 * The calls' numbers, before the gate as in the C hook (gh_gate_call): a
	 * batch of several is held or not as one, by the number of its first.
	 */
	if (num_calls)
		call = __atomic_add_fetch(&gh_hdr->calls, num_calls, __ATOMIC_RELAXED) -
		       num_calls + 1;
	gate = GH_UNLIKELY(__atomic_load_n(&gh_hdr->gate, __ATOMIC_RELAXED) != 0) &&
	       gh_gate_holds(call);
	gh_leave();
	py_busy = 1;
	py_call = call;
	py_stage.head.op = GH_OP_NONE;
	py_stage.head.req_id = 0;
	py_stage.t_end_ns = 0;
	py_stage.t_start_ns = gh_now_ns();
	return (uintptr_t)&py_stage + (uintptr_t)gate;
}

GH_EXPORT uintptr_t gh_py_begin(void)
{
	return py_begin(0);
}

/*
 * gh_py_begin for a call that writes one communication-call record (an op of
 * ring.py's CALL_OPS, at its end or, async, at its completion): numbers it as
 * the C hook numbers its calls, so that the pause gate holds it or not by its
 * number. The capture's wrappers and its C fast path begin with this one.
 */
GH_EXPORT uintptr_t gh_py_begin_call(void)
{
	return py_begin(1);
}

/* The same for a batch that writes num_calls call records (batch_isend_irecv). */
GH_EXPORT uintptr_t gh_py_begin_calls(uint32_t num_calls)
{
	return py_begin(num_calls);
}

/*
 * Ends the captured call: appends the staged record if one was packed (op
 * nonzero), with t_end = now unless the caller packed one, and returns its
 * seq, else 0. Safe to call more than once.
 */
GH_EXPORT uint64_t gh_py_end(void)
{
	uint64_t t_end = gh_now_ns();
	struct gh_py_stage p = py_stage;
	uint64_t seq;

	py_busy = 0;
	py_call = 0;
	py_stage.head.op = GH_OP_NONE;
	if (p.head.op == GH_OP_NONE || p.head.op >= GH_OP_COUNT || !gh_enter())
		return 0;
	if (p.t_end_ns == 0)
		p.t_end_ns = t_end;
	seq = gh_record((uint16_t)p.head.op, GH_SRC_TORCH, p.head.flags, p.t_start_ns, p.t_end_ns,
			p.head.size_bytes, p.head.comm_id, p.head.peer, p.head.req_id, 0);
	gh_leave();
	return seq;
}

/*
 * Ends the captured call with the record's head passed in (struct gh_py_head,
 * pyhead.h): a Python bytes object the capture keeps per operation shape, so
 * that nothing is packed per call (one pointer argument costs ctypes no more
 * than none; typed arguments cost ~0.3 us each), or the C fast path's head on
 * its stack. NULL: nothing to record.
 */
GH_EXPORT uint64_t gh_py_end_head(const void *head)
{
	uint64_t t_end = gh_now_ns();

	if (head) {
		memcpy(&py_stage.head, head, sizeof(py_stage.head));   /* bytes data: unaligned */
		py_stage.t_end_ns = t_end;
	} else {
		py_stage.head.op = GH_OP_NONE;
	}
	return gh_py_end();
}

void gh_py_atfork_child(void)
{
	/* A fork inside a captured call: the child's thread is not inside it. */
	py_busy = 0;
	py_call = 0;
	py_stage.head.op = GH_OP_NONE;
}

/* Describes a torch process group in the ring's communicator table. */
GH_EXPORT void gh_py_comm(uint64_t comm_id, int32_t size, int32_t rank)
{
	uint64_t now;

	if (!gh_enter())
		return;
	gh_comm_publish(comm_id, 0, size, rank, GH_SRC_TORCH, -1);
	now = gh_now_ns(); /* one reading: start == end, never end < start */
	gh_record(GH_OP_COMM_INIT, GH_SRC_TORCH, 0, now, now,
		  (uint64_t)(size > 0 ? size : 0), comm_id, rank, 0, 0);
	gh_leave();
}
