/*
 * greyhound hook: the layout of a per-rank ring file.
 *
 * This header is the one place that defines what the hook writes and what
 * greyhound/ring.py reads; tests/test_hook_layout.py compiles it and checks every
 * offset against the reader's numpy dtypes. Change a field and bump
 * GH_RING_VERSION.
 *
 * A ring file, "<GREYHOUND_RUN_DIR>/ring.<rank>" (mode 0600), is one mapping:
 *
 *   [ struct gh_ring_header        512 bytes                          ]
 *   [ struct gh_comm_entry x comm_capacity    communicators seen      ]
 *   [ struct gh_record     x capacity         the ring, power of two  ]
 *
 * Records are written by the process itself (one or more threads: a slot is
 * claimed with an atomic fetch-add on head, so several producers never share
 * one) and read by the node agent, which publishes how far it has read in
 * reader_pos. When the ring wraps the oldest record is overwritten; if the
 * reader had not consumed it yet, drops is incremented.
 *
 * A slot is committed when its seq equals its index + 1. The producer first
 * stores seq = 0, then the fields, then seq = index + 1 (release), so a reader
 * that copies a slot and sees the same seq before and after the copy holds a
 * record that was not torn.
 *
 * All fields are little-endian, naturally aligned; times are CLOCK_MONOTONIC
 * nanoseconds (t0_realtime_ns - t0_monotonic_ns converts them to Unix time),
 * read through clock_gettime or, with GH_HOOK_TSC in hook_flags, from the TSC
 * fitted to CLOCK_MONOTONIC (within a microsecond; see clock.c).
 */
#ifndef GH_RING_H
#define GH_RING_H

#include <stdint.h>

#define GH_RING_MAGIC      "GHRING1"  /* 7 chars + NUL = 8 bytes */
#define GH_RING_VERSION    2u   /* 2: node, calls, gate_at_call, the GEMM benchmark */
#define GH_RING_HEADER_BYTES 512u
#define GH_COMM_CAPACITY   256u
#define GH_RING_DEFAULT_RECORDS 65536u   /* 4 MiB of records */
#define GH_RING_MIN_RECORDS 16u
#define GH_RING_MAX_RECORDS (1u << 24)

/* Operation codes; greyhound/ring.py OP_NAMES mirrors them (What-if names). */
enum gh_op {
	GH_OP_NONE = 0,
	GH_OP_ALLREDUCE = 1,
	GH_OP_REDUCESCATTER = 2,
	GH_OP_ALLGATHER = 3,
	GH_OP_BROADCAST = 4,
	GH_OP_REDUCE = 5,
	GH_OP_SEND = 6,        /* also Isend / ncclSend (see flags) */
	GH_OP_RECV = 7,        /* also Irecv / ncclRecv */
	GH_OP_SENDRECV = 8,
	GH_OP_BARRIER = 9,
	GH_OP_WAIT = 10,       /* completion of an async op: req_id names it */
	GH_OP_GROUP = 11,      /* ncclGroupStart..End: start..end, size_bytes = ops */
	GH_OP_COMM_INIT = 12,  /* size_bytes = comm size, peer = own rank in comm */
	GH_OP_COMM_SPLIT = 13, /* req_id = parent comm id, peer = own rank */
	GH_OP_COMM_DESTROY = 14,
	GH_OP_PAUSE = 15,      /* the pause gate held this rank from start to end */
	GH_OP_DONE = 16,       /* device completion (CUDA events): req_id = seq of op */
	GH_OP_COUNT
};

/* Record sources. */
enum gh_source {
	GH_SRC_MPI = 1,
	GH_SRC_NCCL = 2,
	GH_SRC_TORCH = 3,
	GH_SRC_HOOK = 4,   /* the hook itself: pause gate */
};

/* Record flags. */
#define GH_F_ASYNC        0x0001u /* t_end is when the call returned, not completion */
#define GH_F_GROUPED      0x0002u /* issued inside ncclGroupStart/End or a batch */
#define GH_F_GATE_TIMEOUT 0x0004u /* PAUSE record: the gate timed out, call went on */
#define GH_F_ERROR        0x0008u /* the real call returned an error (rc) */
#define GH_F_DEVICE_TIMED 0x0010u /* DONE record: t_end - t_start is device time */
#define GH_F_LOCAL_COMM   0x0020u /* comm_id is process-local, not shared by peers */
#define GH_F_IN_PLACE     0x0040u

/* One intercepted call: 64 bytes, one cache line. */
struct gh_record {
	uint64_t seq;          /* index + 1 once committed, 0 while being written */
	uint64_t t_start_ns;   /* call entry */
	uint64_t t_end_ns;     /* call return (completion for blocking calls) */
	uint64_t size_bytes;   /* payload per rank (see docs in ring.py) */
	uint64_t comm_id;      /* communicator id, same on every member */
	uint64_t req_id;       /* async request id; for WAIT/DONE the op completed */
	int32_t peer;          /* p2p peer / root rank in comm, -1 if none */
	uint16_t op;           /* enum gh_op */
	uint8_t source;        /* enum gh_source */
	uint8_t reserved0;
	uint32_t flags;        /* GH_F_* */
	int32_t rc;            /* the call's return code */
};

/* One communicator, appended when first seen. */
struct gh_comm_entry {
	uint64_t comm_id;
	uint64_t parent_id;    /* split parent, 0 if none */
	uint64_t t_create_ns;
	int32_t size;
	int32_t rank;          /* this process's rank in the communicator */
	uint16_t source;
	uint16_t state;        /* 0 empty, 1 live, 2 destroyed; written last */
	int32_t color;         /* split colour, -1 if none */
	uint64_t reserved;
};

#define GH_COMM_EMPTY 0u
#define GH_COMM_LIVE 1u
#define GH_COMM_DESTROYED 2u

struct gh_ring_header {
	/* identity: written once, before magic is published */
	char magic[8];
	uint32_t version;
	uint32_t header_bytes;
	uint32_t record_bytes;
	uint32_t capacity;         /* records, power of two */
	uint64_t records_offset;
	uint64_t comms_offset;
	uint32_t comm_bytes;
	uint32_t comm_capacity;
	int32_t rank;              /* global rank the file is named by, -1 unknown */
	int32_t pid;
	uint64_t t0_monotonic_ns;
	uint64_t t0_realtime_ns;
	uint64_t pause_timeout_ns;
	uint32_t hook_flags;       /* GH_HOOK_* */
	uint32_t reserved0;
	char job_id[32];
	char hostname[64];
	char reserved1[8];
	/* producer cursor, own cache line (calls shares it: both change with every call) */
	_Alignas(64) uint64_t head;          /* next index to write */
	uint64_t calls;                      /* communication calls that reached the gate (below) */
	/* reader cursor, own cache line: written by the agent */
	_Alignas(64) uint64_t reader_pos;
	/* counters and the pause gate */
	_Alignas(64) uint64_t drops;         /* records overwritten before being read */
	uint64_t gate_waits;                 /* how many times a call was held */
	uint64_t gate_timeouts;
	uint64_t parked_since_ns;            /* 0 unless a call is held now */
	uint32_t gate;                       /* set by the agent: nonzero = pause (epoch) */
	uint32_t parked;                     /* threads held at the gate now */
	uint32_t num_comms;                  /* entries claimed in the comm table */
	uint32_t comm_overflow;              /* communicators not stored */
	uint64_t events_skipped;             /* device timings not taken (pool full) */
	/* the consistent pause (see "The pause gate" below) */
	uint64_t gate_at_call;               /* set by the agent: 0 = hold the next call */
	uint64_t parked_at_call;             /* number of the call held now, 0 if none */
	/* the GEMM benchmark, run by a parked thread (see "The benchmark" below) */
	uint64_t bench_ns;                   /* wall-clock ns of the last GEMM */
	uint64_t bench_cpu_ns;               /* its thread CPU ns */
	uint32_t bench_n;                    /* set by the agent: matrix size */
	uint32_t bench_request;              /* set by the agent: epoch of the request */
	uint32_t bench_done;                 /* epoch answered (release, after the result) */
	uint32_t bench_status;               /* enum gh_bench_status of bench_done */
	char reserved2[24];
	/* the node the writer ran on, own cache line: written once, before magic */
	_Alignas(64) char node[64];          /* SLURMD_NODENAME, else the hostname */
};

/*
 * The pause gate. A call the hook records passes gh_gate_call (hook.h), which
 * gives it the next number of the ring's call counter: calls is the number of
 * communication calls (the ops of ring.py's CALL_OPS: AllReduce, ReduceScatter,
 * AllGather, Broadcast, Reduce, Send, Recv, SendRecv, Barrier; not Wait, Group,
 * communicator events or Pause) that reached the gate, the one held there
 * included. A thread that makes its calls one after another (every MPI rank
 * and torch program here) writes each call's record before its next call
 * starts, so the k-th call record of the ring is call number k. (Calls made
 * concurrently by several threads are numbered in the order they start, and
 * their records are claimed in the order they end.)
 *
 * gate = 0: nothing is held. gate = an epoch, gate_at_call = 0: the next call
 * of any kind (a Wait too) is held, as in layout version 1. gate = an epoch,
 * gate_at_call = T: communication calls numbered < T pass, the first one
 * numbered >= T is held before it is made (parked_at_call says which), and
 * non-communication calls pass. The agent writes gate_at_call before gate. A
 * held thread goes on when gate is cleared, or when the ring's pause timeout
 * has passed since it parked (that epoch is then ignored from there on).
 *
 * The benchmark. A parked thread (one at a time per process) that sees
 * bench_request != bench_done runs an N x N x N single-precision GEMM
 * (N = bench_n) in the rank's own process, CPU set and cgroup, writes bench_ns,
 * bench_cpu_ns and bench_status, then stores bench_done = bench_request
 * (release), and stays parked. The GEMM stops early when the gate is cleared
 * or the pause timeout passes (the rank is released on time); a request still
 * open when the last parked thread leaves is answered GH_BENCH_NOT_PARKED.
 * CPU only: on a GPU rank the same request would run in its CUDA context
 * (not built).
 */
enum gh_bench_status {
	GH_BENCH_NONE = 0,        /* nothing answered yet */
	GH_BENCH_OK = 1,
	GH_BENCH_TIMEOUT = 2,     /* stopped: the pause timeout passed */
	GH_BENCH_RESUMED = 3,     /* stopped: the gate was cleared */
	GH_BENCH_BAD_SIZE = 4,    /* bench_n outside [GH_BENCH_MIN_N, GH_BENCH_MAX_N] */
	GH_BENCH_NO_MEMORY = 5,   /* the matrices could not be mapped */
	GH_BENCH_NOT_PARKED = 6,  /* the rank left the gate before it got to it */
};
#define GH_BENCH_MIN_N 16u
#define GH_BENCH_MAX_N 4096u

#define GH_HOOK_TRACE 0x1u   /* GREYHOUND_TRACE=on: device timing of NCCL ops */
#define GH_HOOK_TSC 0x2u     /* times are read from the TSC, fitted to CLOCK_MONOTONIC */

_Static_assert(sizeof(struct gh_record) == 64, "record is one cache line");
_Static_assert(sizeof(struct gh_comm_entry) == 48, "comm entry size");
_Static_assert(sizeof(struct gh_ring_header) == GH_RING_HEADER_BYTES, "header size");

#endif
