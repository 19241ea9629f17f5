/*
 * The record head the Python capture hands to gh_py_end_head: struct "<IIiIQQQ"
 * (_HEAD in greyhound/capture/_greyhound_capture.py), 40 bytes. Shared by the hook
 * (spank/hook/pyapi.c) and the capture's C fast path (spank/capture/fastpath.c),
 * which builds it on the stack.
 */
#ifndef GH_PYHEAD_H
#define GH_PYHEAD_H

#include <stdint.h>

struct gh_py_head {
	uint32_t op;
	uint32_t flags;
	int32_t peer;
	uint32_t reserved;
	uint64_t comm_id;
	uint64_t size_bytes;
	uint64_t req_id;
};

_Static_assert(sizeof(struct gh_py_head) == 40, "matches _HEAD in _greyhound_capture.py");

#endif /* GH_PYHEAD_H */
