/*
 * greyhound hook: process state, the ring file, the pause gate, fork.
 *
 * Nothing happens at load time: the ring is opened by the first intercepted
 * call, so a program that never calls NCCL or MPI gets no file, no thread and
 * no message. Any failure turns the hook off for the process (calls still go
 * through untouched) and prints one line on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

int gh_state_cached = GH_UNINIT;
__thread int gh_nesting __attribute__((tls_model("initial-exec")));
struct gh_ring_header *gh_hdr;
struct gh_record *gh_records;
uint64_t gh_mask;
struct gh_comm_entry *gh_comm_table;
uint32_t gh_comm_capacity;
int gh_trace;

static uint64_t pause_timeout_ns = 60ull * 1000000000ull;
static uint32_t gate_released_epoch; /* a gate epoch that timed out is not obeyed again */
static uint64_t problems_reported;
static int atfork_registered;

void gh_log_once(enum gh_problem problem, const char *fmt, ...)
{
	char buf[512];
	va_list ap;
	int n, m;
	uint64_t bit = 1ull << problem;

	if (__atomic_fetch_or(&problems_reported, bit, __ATOMIC_RELAXED) & bit)
		return;
	n = snprintf(buf, sizeof(buf), "greyhound: hook: ");
	va_start(ap, fmt);
	m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (m < 0)
		return;
	n += m;
	if ((size_t)n > sizeof(buf) - 2)
		n = (int)sizeof(buf) - 2; /* truncated: still one line */
	buf[n++] = '\n';
	/* write(2) directly: no stdio lock or buffer in a signal/fork-unsafe spot */
	if (write(STDERR_FILENO, buf, (size_t)n) < 0)
		return;
}

static void set_state(int s)
{
	__atomic_store_n(&gh_state_cached, s, __ATOMIC_RELEASE);
}

/* Strict integer parse: the whole string, in [lo, hi]. */
static int parse_long(const char *s, long lo, long hi, long *out)
{
	char *end;
	long v;

	if (!s || !*s)
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

/* The global rank the ring is named by: the first launcher variable that is set. */
static long global_rank(void)
{
	static const char *const vars[] = { "SLURM_PROCID", "RANK",
					    "OMPI_COMM_WORLD_RANK", "PMI_RANK" };
	long rank;

	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
		const char *v = getenv(vars[i]);

		if (!v)
			continue;
		if (parse_long(v, 0, 1L << 30, &rank) == 0)
			return rank;
		gh_log_once(GH_P_RANK, "%s=\"%.40s\" is not a rank; trying the next variable",
			    vars[i], v);
	}
	return -1;
}

/*
 * A variable that takes one of two words: 0 for the first, 1 for the second,
 * -1 when it is unset or empty, -2 (after one line) for anything else.
 */
static int env_choice(const char *name, const char *first, const char *second)
{
	const char *v = getenv(name);

	if (!v || !*v)
		return -1;
	if (strcmp(v, first) == 0)
		return 0;
	if (strcmp(v, second) == 0)
		return 1;
	gh_log_once(GH_P_BAD_ENV, "%s=\"%.40s\": expected %s or %s; recording off", name, v,
		    first, second);
	return -2;
}

static int read_config(uint32_t *capacity, uint32_t *hook_flags, int *allow_tsc)
{
	const char *v;
	long n;
	int clock, trace;

	*capacity = GH_RING_DEFAULT_RECORDS;
	*hook_flags = 0;
	*allow_tsc = 1;

	clock = env_choice("GREYHOUND_CLOCK", "auto", "monotonic");
	if (clock == -2)
		return -1;
	if (clock == 1)
		*allow_tsc = 0;
	trace = env_choice("GREYHOUND_TRACE", "on", "off");
	if (trace == -2)
		return -1;
	if (trace == 0)
		*hook_flags |= GH_HOOK_TRACE;
	v = getenv("GREYHOUND_PAUSE_TIMEOUT_S");
	if (v && *v) {
		char *end;
		double s;

		errno = 0;
		s = strtod(v, &end);
		if (errno || *end || !isfinite(s) || s < 0 || s > 86400) {
			gh_log_once(GH_P_BAD_ENV, "GREYHOUND_PAUSE_TIMEOUT_S=\"%.40s\": expected seconds in [0, 86400]; recording off", v);
			return -1;
		}
		pause_timeout_ns = (uint64_t)(s * 1e9);
	}
	v = getenv("GREYHOUND_RING_RECORDS");
	if (v && *v) {
		if (parse_long(v, GH_RING_MIN_RECORDS, GH_RING_MAX_RECORDS, &n) ||
		    (n & (n - 1)) != 0) {
			gh_log_once(GH_P_BAD_ENV, "GREYHOUND_RING_RECORDS=\"%.40s\": expected a power of two in [%u, %u]; recording off",
				    v, GH_RING_MIN_RECORDS, GH_RING_MAX_RECORDS);
			return -1;
		}
		*capacity = (uint32_t)n;
	}
	return 0;
}

/* Reserves the file's blocks now, so a full disk fails here and not as SIGBUS later. */
static int reserve(int fd, size_t bytes)
{
	static const char zeros[65536];
	struct rlimit lim;
	int rv;

	/* Growing a file past RLIMIT_FSIZE raises SIGXFSZ, which kills: check first. */
	if (getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
	    lim.rlim_cur < bytes) {
		errno = EFBIG;
		return -1;
	}
	rv = posix_fallocate(fd, 0, (off_t)bytes);

	if (rv == 0)
		return 0;
	if (rv != EOPNOTSUPP && rv != EINVAL) {
		errno = rv;
		return -1;
	}
	for (size_t off = 0; off < bytes; off += sizeof(zeros)) {
		size_t len = bytes - off < sizeof(zeros) ? bytes - off : sizeof(zeros);

		if (pwrite(fd, zeros, len, (off_t)off) != (ssize_t)len)
			return -1;
	}
	return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#define PREFAULT_MAX (64u << 20)

/*
 * Faults the ring's pages in now, writable, so that the program's calls do not
 * take the first write fault of each page (6 us on ext4, 2 us on tmpfs: ~90 ns
 * a record over the ring's first pass) one by one later. Best effort.
 */
static void prefault(char *base, size_t bytes)
{
	if (bytes > PREFAULT_MAX)
		bytes = PREFAULT_MAX; /* a huge ring: only its start */
	if (madvise(base, bytes, MADV_POPULATE_WRITE) == 0)
		return;
	/* Older kernels: touch each page (the file is all zeros, so is what is written). */
	for (size_t off = 0; off < bytes; off += 4096)
		__atomic_store_n(base + off, 0, __ATOMIC_RELAXED);
}

static int open_ring_file(const char *dir, long rank, char *path, size_t path_len)
{
	int fd, n;

	if (rank >= 0)
		n = snprintf(path, path_len, "%s/ring.%ld", dir, rank);
	else
		n = snprintf(path, path_len, "%s/ring.pid%ld", dir, (long)getpid());
	if (n < 0 || (size_t)n >= path_len) {
		errno = ENAMETOOLONG;
		return -1;
	}
	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd >= 0 || errno != EEXIST || rank < 0)
		return fd;
	/* Taken: an earlier step of the job, or a forked child of this rank. */
	n = snprintf(path, path_len, "%s/ring.%ld.%ld", dir, rank, (long)getpid());
	if (n < 0 || (size_t)n >= path_len) {
		errno = ENAMETOOLONG;
		return -1;
	}
	return open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
}

static void bench_atfork_child(void);

static void atfork_child(void)
{
	/*
	 * The mapping is shared with the parent: the child must not write into the
	 * parent's ring. It starts over and opens its own ring if it ever calls.
	 * The old mapping is left in place (not written again) so that a pointer
	 * the Python capture still holds to the gate word stays readable.
	 */
	gh_hdr = NULL;
	gh_records = NULL;
	gh_comm_table = NULL;
	gh_comm_capacity = 0;
	gh_nccl_atfork_child();
	gh_py_atfork_child();
	gh_clock_atfork_child();
	bench_atfork_child();
	set_state(GH_UNINIT);
}

/*
 * The control plane's own processes (the SPANK plugin sets GREYHOUND_CONTROL_PLANE=1
 * in their environment): no ring, every call passes through.
 */
static int in_control_plane(void)
{
	const char *v = getenv("GREYHOUND_CONTROL_PLANE");

	return v && strcmp(v, "1") == 0;
}

/* Where the parts of a ring of `capacity` records lie in its file. */
struct ring_layout {
	uint32_t capacity;
	size_t comms_offset, records_offset, bytes;
};

static int ring_layout(uint32_t capacity, struct ring_layout *l)
{
	l->capacity = capacity;
	l->comms_offset = GH_RING_HEADER_BYTES;
	l->records_offset = l->comms_offset + GH_COMM_CAPACITY * sizeof(struct gh_comm_entry);
	l->bytes = l->records_offset + (size_t)capacity * sizeof(struct gh_record);
	if (capacity < GH_RING_MIN_RECORDS || capacity > GH_RING_MAX_RECORDS ||
	    (capacity & (capacity - 1)) != 0 || l->records_offset % _Alignof(struct gh_record) != 0) {
		gh_log_once(GH_P_RING_OPEN, "ring layout of %u records is not valid; recording off",
			    capacity);
		return -1;
	}
	return 0;
}

/* A string into a fixed-size field of the header: truncated if need be, terminated. */
static void set_field(char *field, size_t size, const char *value)
{
	if (snprintf(field, size, "%s", value) >= (int)size)
		field[size - 1] = '\0';
}

/* Fills the header of a new ring; its magic, written last, makes it one to readers. */
static void write_header(struct gh_ring_header *hdr, const struct ring_layout *l, long rank,
			 uint32_t hook_flags, int allow_tsc)
{
	const char *job = getenv("GREYHOUND_JOB_ID");
	const char *node = getenv("SLURMD_NODENAME");
	struct timespec rt;

	hdr->version = GH_RING_VERSION;
	hdr->header_bytes = GH_RING_HEADER_BYTES;
	hdr->record_bytes = sizeof(struct gh_record);
	hdr->capacity = l->capacity;
	hdr->comms_offset = l->comms_offset;
	hdr->comm_bytes = sizeof(struct gh_comm_entry);
	hdr->comm_capacity = GH_COMM_CAPACITY;
	hdr->records_offset = l->records_offset;
	hdr->rank = (int32_t)rank;
	hdr->pid = (int32_t)getpid();
	/*
	 * GH_HOOK_TSC is added by clock.c once the TSC is fitted (about 1 ms in);
	 * a forked child inherits its parent's fit.
	 */
	if (gh_clock_init(allow_tsc) && __atomic_load_n(&gh_clock.mult, __ATOMIC_RELAXED))
		hook_flags |= GH_HOOK_TSC;
	clock_gettime(CLOCK_REALTIME, &rt);
	hdr->t0_monotonic_ns = gh_mono_ns();
	hdr->t0_realtime_ns = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
	hdr->pause_timeout_ns = pause_timeout_ns;
	hdr->hook_flags = hook_flags;
	if (job)
		set_field(hdr->job_id, sizeof(hdr->job_id), job);
	if (gethostname(hdr->hostname, sizeof(hdr->hostname) - 1) < 0)
		hdr->hostname[0] = '\0';
	/* Several emulated Slurm nodes (slurmd -N) may share one host: the node says whose. */
	if (node && *node)
		set_field(hdr->node, sizeof(hdr->node), node);
	else
		memcpy(hdr->node, hdr->hostname, sizeof(hdr->node));
	/* Magic last: a reader that sees it sees a complete header. */
	__atomic_thread_fence(__ATOMIC_RELEASE);
	memcpy(hdr->magic, GH_RING_MAGIC, sizeof(GH_RING_MAGIC));
}

static int open_ring(void)
{
	const char *dir = getenv("GREYHOUND_RUN_DIR");
	char path[4096];
	uint32_t capacity, hook_flags;
	int allow_tsc;
	struct ring_layout l = { .bytes = 0 };
	struct gh_ring_header *hdr = MAP_FAILED;
	long rank;
	int fd = -1, rv = -1, created = 0;

	path[0] = '\0';
	if (in_control_plane())
		goto fail;
	if (!dir || !*dir) {
		gh_log_once(GH_P_NO_RUN_DIR, "GREYHOUND_RUN_DIR is not set; recording off");
		goto fail;
	}
	if (read_config(&capacity, &hook_flags, &allow_tsc) < 0)
		goto fail;
	rank = global_rank();
	/* The layout, fixed here and kept in process-private memory (see hook.h). */
	if (ring_layout(capacity, &l) < 0)
		goto fail;

	fd = open_ring_file(dir, rank, path, sizeof(path));
	if (fd < 0) {
		gh_log_once(GH_P_RING_OPEN, "cannot create a ring in %.200s: %s; recording off",
			    dir, strerror(errno));
		goto fail;
	}
	created = 1;
	if (reserve(fd, l.bytes) < 0) {
		gh_log_once(GH_P_RING_OPEN, "cannot reserve %zu bytes for %.200s: %s; recording off",
			    l.bytes, path, strerror(errno));
		goto fail;
	}
	hdr = mmap(NULL, l.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (hdr == MAP_FAILED) {
		gh_log_once(GH_P_RING_OPEN, "cannot map %.200s: %s; recording off", path,
			    strerror(errno));
		goto fail;
	}
	prefault((char *)hdr, l.bytes);
	write_header(hdr, &l, rank, hook_flags, allow_tsc);

	/* From the private values, never from the header just written (see hook.h). */
	gh_records = (struct gh_record *)((char *)hdr + l.records_offset);
	gh_mask = capacity - 1;
	gh_comm_table = (struct gh_comm_entry *)((char *)hdr + l.comms_offset);
	gh_comm_capacity = GH_COMM_CAPACITY;
	gh_trace = (hook_flags & GH_HOOK_TRACE) != 0;
	gh_hdr = hdr;
	hdr = MAP_FAILED; /* owned by the process state now */
	rv = 0;
fail:
	if (hdr != MAP_FAILED)
		munmap(hdr, l.bytes);
	if (fd >= 0)
		close(fd);
	if (rv < 0 && created)
		unlink(path);
	return rv;
}

int gh_init_slow(void)
{
	int expected = GH_UNINIT;

	if (!__atomic_compare_exchange_n(&gh_state_cached, &expected, GH_INITIALISING, 0,
					 __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
		return expected == GH_ON; /* another thread is opening it: pass through */
	if (!atfork_registered) {
		if (pthread_atfork(NULL, NULL, atfork_child) != 0) {
			gh_log_once(GH_P_FORK, "pthread_atfork failed; recording off");
			set_state(GH_OFF);
			return 0;
		}
		atfork_registered = 1;
	}
	if (open_ring() < 0) {
		set_state(GH_OFF);
		return 0;
	}
	set_state(GH_ON);
	return 1;
}

int gh_abi_check_slow(int *state, int (*check)(void))
{
	int expected = GH_ABI_UNCHECKED, verdict;

	if (!__atomic_compare_exchange_n(state, &expected, GH_ABI_CHECKING, 0, __ATOMIC_ACQ_REL,
					 __ATOMIC_ACQUIRE))
		return expected == GH_ABI_OK; /* foreign, or another thread is checking: pass through */
	verdict = check() == 0 ? GH_ABI_OK : GH_ABI_FOREIGN;
	__atomic_store_n(state, verdict, __ATOMIC_RELEASE);
	return verdict == GH_ABI_OK;
}

/*
 * Whether a gate epoch holds the call numbered call (0: not a communication
 * call). The agent writes gate_at_call before gate, so it is read after the
 * epoch (acquire).
 */
static int epoch_holds(struct gh_ring_header *hdr, uint32_t epoch, uint64_t call)
{
	uint64_t at;

	if (epoch == 0 || epoch == __atomic_load_n(&gate_released_epoch, __ATOMIC_RELAXED))
		return 0;
	at = __atomic_load_n(&hdr->gate_at_call, __ATOMIC_ACQUIRE);
	return at == 0 || (call != 0 && call >= at);
}

int gh_gate_holds(uint64_t call)
{
	struct gh_ring_header *hdr = gh_hdr;

	return hdr && epoch_holds(hdr, __atomic_load_n(&hdr->gate, __ATOMIC_ACQUIRE), call);
}

/* ---- the GEMM benchmark of a parked rank ------------------------------------ */

#define BENCH_BLOCK 64
/* Only one parked thread of the process benchmarks at a time; the matrices are its. */
static int bench_busy;
static float *bench_mem;       /* A, B, C of the largest size asked so far; kept */
static size_t bench_mem_bytes;
static volatile float bench_sink;

static int bench_map(uint32_t n)
{
	size_t bytes = 3 * (size_t)n * n * sizeof(float);
	void *p;

	if (bytes <= bench_mem_bytes)
		return 0;
	/* mmap, not malloc: the program's allocator (and its locks) stays out of this. */
	p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return -1;
	if (bench_mem)
		munmap(bench_mem, bench_mem_bytes);
	bench_mem = p;
	bench_mem_bytes = bytes;
	return 0;
}

static void bench_atfork_child(void)
{
	/*
	 * Forked while another thread benchmarked: that thread is not in the child.
	 * The matrices (a private mapping) stay, copy-on-write, for the child's use.
	 */
	bench_busy = 0;
}

static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;

	if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) < 0)
		return 0;
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * C += A B, n x n, single precision, one thread: blocks of BENCH_BLOCK, i-k-j
 * inside a block so that the innermost loop streams a row of B into a row of C.
 * Between blocks it looks at the clock and the gate: it stops (and says why)
 * once the gate is cleared or the deadline passes, so the rank is released on
 * time whatever n is. Returns an enum gh_bench_status.
 */
static int bench_gemm(struct gh_ring_header *hdr, uint32_t n, uint64_t deadline,
		      uint64_t *wall_ns, uint64_t *cpu_ns)
{
	float *a, *b, *c;
	uint64_t t0, c0;
	size_t nn = (size_t)n * n;
	float sum = 0;

	if (n < GH_BENCH_MIN_N || n > GH_BENCH_MAX_N)
		return GH_BENCH_BAD_SIZE;
	if (bench_map(n) < 0)
		return GH_BENCH_NO_MEMORY;
	a = bench_mem;
	b = a + nn;
	c = b + nn;
	/* Values that stay small and exact enough; writing them also faults the pages in. */
	for (size_t i = 0; i < nn; i++) {
		a[i] = (float)((i * 7 + 3) % 17) * 0.0625f;
		b[i] = (float)((i * 5 + 1) % 13) * 0.0625f;
		c[i] = 0.0f;
	}
	t0 = gh_mono_ns();
	c0 = thread_cpu_ns();
	for (uint32_t ii = 0; ii < n; ii += BENCH_BLOCK) {
		uint32_t ie = ii + BENCH_BLOCK < n ? ii + BENCH_BLOCK : n;

		for (uint32_t kk = 0; kk < n; kk += BENCH_BLOCK) {
			uint32_t ke = kk + BENCH_BLOCK < n ? kk + BENCH_BLOCK : n;

			if (__atomic_load_n(&hdr->gate, __ATOMIC_RELAXED) == 0)
				return GH_BENCH_RESUMED;
			if (gh_mono_ns() >= deadline)
				return GH_BENCH_TIMEOUT;
			for (uint32_t jj = 0; jj < n; jj += BENCH_BLOCK) {
				uint32_t je = jj + BENCH_BLOCK < n ? jj + BENCH_BLOCK : n;

				for (uint32_t i = ii; i < ie; i++) {
					float *restrict crow = c + (size_t)i * n;

					for (uint32_t k = kk; k < ke; k++) {
						const float aik = a[(size_t)i * n + k];
						const float *restrict brow = b + (size_t)k * n;

						for (uint32_t j = jj; j < je; j++)
							crow[j] += aik * brow[j];
					}
				}
			}
		}
	}
	*wall_ns = gh_mono_ns() - t0;
	*cpu_ns = thread_cpu_ns() - c0;
	/* The result is used, so the compiler keeps the work. */
	for (uint32_t i = 0; i < n; i++)
		sum += c[(size_t)i * n + i];
	bench_sink = sum;
	return GH_BENCH_OK;
}

/* A parked thread answers an open benchmark request, unless another one is at it. */
static void bench_serve(struct gh_ring_header *hdr, uint64_t deadline)
{
	uint32_t req = __atomic_load_n(&hdr->bench_request, __ATOMIC_ACQUIRE);
	uint64_t wall = 0, cpu = 0;
	int expected = 0, status;

	if (req == __atomic_load_n(&hdr->bench_done, __ATOMIC_ACQUIRE))
		return;
	if (!__atomic_compare_exchange_n(&bench_busy, &expected, 1, 0, __ATOMIC_ACQUIRE,
					 __ATOMIC_RELAXED))
		return;
	/* bench_n was written before bench_request (the reader's order). */
	status = bench_gemm(hdr, __atomic_load_n(&hdr->bench_n, __ATOMIC_RELAXED), deadline,
			    &wall, &cpu);
	__atomic_store_n(&hdr->bench_ns, wall, __ATOMIC_RELAXED);
	__atomic_store_n(&hdr->bench_cpu_ns, cpu, __ATOMIC_RELAXED);
	__atomic_store_n(&hdr->bench_status, (uint32_t)status, __ATOMIC_RELAXED);
	__atomic_store_n(&hdr->bench_done, req, __ATOMIC_RELEASE);
	__atomic_store_n(&bench_busy, 0, __ATOMIC_RELEASE);
}

/* ---- the pause gate --------------------------------------------------------- */

void gh_gate_slow(uint64_t call)
{
	struct gh_ring_header *hdr = gh_hdr;
	uint32_t epoch = __atomic_load_n(&hdr->gate, __ATOMIC_ACQUIRE);
	uint64_t t0, t, deadline;
	int timed_out = 0;

	if (!epoch_holds(hdr, epoch, call))
		return;
	t0 = gh_now_ns();
	/* The deadline is fixed when the thread parks: a new epoch does not extend it. */
	deadline = gh_mono_ns() + pause_timeout_ns;
	__atomic_fetch_add(&hdr->gate_waits, 1, __ATOMIC_RELAXED);
	if (__atomic_fetch_add(&hdr->parked, 1, __ATOMIC_ACQ_REL) == 0) {
		__atomic_store_n(&hdr->parked_at_call, call, __ATOMIC_RELAXED);
		__atomic_store_n(&hdr->parked_since_ns, t0, __ATOMIC_RELEASE);
	}
	for (;;) {
		struct timespec nap = { 0, 500000 }; /* 0.5 ms: the gate is seconds-scale */
		uint32_t e = __atomic_load_n(&hdr->gate, __ATOMIC_ACQUIRE);

		if (e == 0)
			break;
		if (e != epoch) {
			/* Paused again meanwhile (say, at another call): held only if that holds. */
			epoch = e;
			if (!epoch_holds(hdr, e, call))
				break;
		}
		if (gh_mono_ns() >= deadline) {
			/* The agent is gone or stuck: go on, and ignore this epoch from now on. */
			__atomic_store_n(&gate_released_epoch, e, __ATOMIC_RELAXED);
			timed_out = 1;
			break;
		}
		bench_serve(hdr, deadline);
		nanosleep(&nap, NULL);
	}
	t = gh_now_ns();
	if (__atomic_sub_fetch(&hdr->parked, 1, __ATOMIC_ACQ_REL) == 0) {
		uint32_t req = __atomic_load_n(&hdr->bench_request, __ATOMIC_ACQUIRE);

		__atomic_store_n(&hdr->parked_since_ns, 0, __ATOMIC_RELEASE);
		__atomic_store_n(&hdr->parked_at_call, 0, __ATOMIC_RELAXED);
		/* A request nobody here will answer now: say so rather than leave it open. */
		if (req != __atomic_load_n(&hdr->bench_done, __ATOMIC_ACQUIRE) &&
		    !__atomic_load_n(&bench_busy, __ATOMIC_ACQUIRE)) {
			__atomic_store_n(&hdr->bench_status, GH_BENCH_NOT_PARKED, __ATOMIC_RELAXED);
			__atomic_store_n(&hdr->bench_done, req, __ATOMIC_RELEASE);
		}
	}
	if (timed_out)
		__atomic_fetch_add(&hdr->gate_timeouts, 1, __ATOMIC_RELAXED);
	gh_record(GH_OP_PAUSE, GH_SRC_HOOK, timed_out ? GH_F_GATE_TIMEOUT : 0, t0, t, 0, 0,
		  -1, epoch, 0);
}

void gh_comm_publish(uint64_t comm_id, uint64_t parent_id, int32_t size, int32_t rank,
		     uint16_t source, int32_t color)
{
	struct gh_ring_header *hdr = gh_hdr;
	struct gh_comm_entry *table;
	uint32_t idx;

	if (!hdr)
		return;
	/* num_comms is shared (a reader may have scribbled on it): checked against our capacity. */
	idx = __atomic_fetch_add(&hdr->num_comms, 1, __ATOMIC_RELAXED);
	if (idx >= gh_comm_capacity) {
		__atomic_fetch_add(&hdr->comm_overflow, 1, __ATOMIC_RELAXED);
		gh_log_once(GH_P_COMM_TABLE, "more than %u communicators; later ones are not described in the ring",
			    gh_comm_capacity);
		return;
	}
	table = gh_comm_table;
	table[idx].comm_id = comm_id;
	table[idx].parent_id = parent_id;
	table[idx].t_create_ns = gh_now_ns();
	table[idx].size = size;
	table[idx].rank = rank;
	table[idx].source = source;
	table[idx].color = color;
	__atomic_store_n(&table[idx].state, GH_COMM_LIVE, __ATOMIC_RELEASE);
}

void gh_comm_retire(uint64_t comm_id)
{
	struct gh_ring_header *hdr = gh_hdr;
	struct gh_comm_entry *table;
	uint32_t n;

	if (!hdr)
		return;
	table = gh_comm_table;
	n = __atomic_load_n(&hdr->num_comms, __ATOMIC_ACQUIRE);
	if (n > gh_comm_capacity)
		n = gh_comm_capacity;
	for (uint32_t i = n; i-- > 0;) {
		if (table[i].comm_id == comm_id &&
		    __atomic_load_n(&table[i].state, __ATOMIC_ACQUIRE) == GH_COMM_LIVE) {
			__atomic_store_n(&table[i].state, GH_COMM_DESTROYED, __ATOMIC_RELEASE);
			return;
		}
	}
}
