/*
 * A test double of the CUDA runtime calls the hook makes (tests only; no GPU
 * here). Events take the host's CLOCK_MONOTONIC when recorded; the NCCL double
 * runs its work synchronously, so the time between two events is the work's
 * duration.
 *
 * It keeps the runtime's state the hook must not disturb:
 * - the thread's last error: every failing call sets it, cudaGetLastError
 *   returns and clears it, cudaPeekAtLastError returns it;
 * - CUDART_DOUBLE_NOT_READY=N: an event answers cudaErrorNotReady to its first
 *   N queries after each record, as an event of unfinished work does;
 * - stream capture (one stream at a time): an event recorded on the capturing
 *   stream becomes part of the graph; cudaEventQuery is a "potentially unsafe"
 *   call, which during a capture in the global mode, from a thread that is not
 *   in the relaxed mode, fails and invalidates the capture, so that
 *   cudaStreamEndCapture then fails as the real runtime's does.
 */
#include <stdlib.h>
#include <time.h>

#define ERR_INVALID_VALUE 1
#define ERR_MEMORY_ALLOCATION 2
#define ERR_INVALID_RESOURCE_HANDLE 400
#define ERR_NOT_READY 600
#define ERR_CAPTURE_UNSUPPORTED 900
#define ERR_CAPTURE_INVALIDATED 901
#define CAPTURE_MODE_GLOBAL 0
#define CAPTURE_MODE_RELAXED 2
#define CAPTURE_STATUS_NONE 0
#define CAPTURE_STATUS_ACTIVE 1
#define CAPTURE_STATUS_INVALIDATED 2

struct event {
	double t_ms;
	int recorded;
	int queries_left;  /* answered cudaErrorNotReady */
	int captured;      /* recorded into a capture: a node of its graph */
};

static __thread int last_error;
static __thread int thread_mode; /* cudaThreadExchangeStreamCaptureMode; 0 = global */
static void *capturing;          /* the stream being captured, NULL if none */
static int capture_mode;
static int capture_invalidated;

static int fail(int rc)
{
	last_error = rc;
	return rc;
}

static int not_ready_queries(void)
{
	const char *v = getenv("CUDART_DOUBLE_NOT_READY");

	return v ? atoi(v) : 0;
}

int cudaGetLastError(void)
{
	int rc = last_error;

	last_error = 0;
	return rc;
}

int cudaPeekAtLastError(void)
{
	return last_error;
}

int cudaEventCreateWithFlags(void **event, unsigned int flags)
{
	(void)flags;
	*event = calloc(1, sizeof(struct event));
	return *event ? 0 : fail(ERR_MEMORY_ALLOCATION);
}

int cudaEventRecord(void *event, void *stream)
{
	struct event *e = event;
	struct timespec ts;

	if (!e)
		return fail(ERR_INVALID_RESOURCE_HANDLE);
	e->recorded = 1;
	e->captured = stream && stream == capturing;
	if (e->captured)
		return 0;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	e->t_ms = ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
	e->queries_left = not_ready_queries();
	return 0;
}

int cudaEventQuery(void *event)
{
	struct event *e = event;

	if (!e)
		return fail(ERR_INVALID_RESOURCE_HANDLE);
	if (capturing && capture_mode == CAPTURE_MODE_GLOBAL && thread_mode != CAPTURE_MODE_RELAXED) {
		capture_invalidated = 1;
		return fail(ERR_CAPTURE_UNSUPPORTED);
	}
	if (e->captured) {
		if (capturing)
			capture_invalidated = 1;
		return fail(ERR_CAPTURE_UNSUPPORTED);
	}
	if (e->recorded && e->queries_left > 0) {
		e->queries_left--;
		return fail(ERR_NOT_READY);
	}
	return 0;
}

int cudaEventElapsedTime(float *ms, void *start, void *end)
{
	struct event *s = start, *e = end;

	if (!s || !e || !s->recorded || !e->recorded || s->captured || e->captured)
		return fail(ERR_INVALID_RESOURCE_HANDLE);
	*ms = (float)(e->t_ms - s->t_ms);
	return 0;
}

int cudaEventDestroy(void *event)
{
	free(event);
	return 0;
}

int cudaStreamBeginCapture(void *stream, int mode)
{
	if (!stream || capturing)
		return fail(ERR_INVALID_VALUE);
	capturing = stream;
	capture_mode = mode;
	capture_invalidated = 0;
	return 0;
}

int cudaStreamEndCapture(void *stream, void **graph)
{
	if (!stream || stream != capturing)
		return fail(ERR_INVALID_VALUE);
	capturing = NULL;
	*graph = NULL;
	if (capture_invalidated)
		return fail(ERR_CAPTURE_INVALIDATED);
	*graph = stream; /* a stand-in handle: nothing launches it */
	return 0;
}

int cudaStreamIsCapturing(void *stream, int *status)
{
	if (stream && stream == capturing)
		*status = capture_invalidated ? CAPTURE_STATUS_INVALIDATED : CAPTURE_STATUS_ACTIVE;
	else
		*status = CAPTURE_STATUS_NONE;
	return 0;
}

int cudaThreadExchangeStreamCaptureMode(int *mode)
{
	int old = thread_mode;

	if (*mode < 0 || *mode > CAPTURE_MODE_RELAXED)
		return fail(ERR_INVALID_VALUE);
	thread_mode = *mode;
	*mode = old;
	return 0;
}
