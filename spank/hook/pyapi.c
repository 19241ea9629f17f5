/*
 * greyhound hook: the entry points the Python capture calls through ctypes.
 *
 * torch.distributed's gloo backend does its communication inside libtorch,
 * where no interposition can see it; greyhound/capture wraps the Python API
 * and writes the same records into the same ring through these functions.
 */
#define _GNU_SOURCE
#include <stdint.h>

#include "hook.h"

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

/* The pause gate; returns at once unless the agent has set it. */
GH_EXPORT void gh_py_gate(void)
{
	if (!gh_enter())
		return;
	gh_gate();
	gh_leave();
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

/* Describes a torch process group in the ring's communicator table. */
GH_EXPORT void gh_py_comm(uint64_t comm_id, int32_t size, int32_t rank)
{
	if (!gh_enter())
		return;
	gh_comm_publish(comm_id, 0, size, rank, GH_SRC_TORCH, -1);
	gh_record(GH_OP_COMM_INIT, GH_SRC_TORCH, 0, gh_now_ns(), gh_now_ns(),
		  (uint64_t)(size > 0 ? size : 0), comm_id, rank, 0, 0);
	gh_leave();
}
