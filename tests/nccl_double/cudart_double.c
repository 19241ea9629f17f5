/*
 * A test double of the CUDA runtime's event calls (tests only; no GPU here).
 * Events take the host's CLOCK_MONOTONIC when recorded; the NCCL double runs its
 * work synchronously, so the time between two events is the work's duration.
 */
#include <stdlib.h>
#include <time.h>

struct event {
	double t_ms;
	int recorded;
};

int cudaEventCreateWithFlags(void **event, unsigned int flags)
{
	(void)flags;
	*event = calloc(1, sizeof(struct event));
	return *event ? 0 : 2; /* cudaErrorMemoryAllocation */
}

int cudaEventRecord(void *event, void *stream)
{
	struct event *e = event;
	struct timespec ts;

	(void)stream;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	e->t_ms = ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
	e->recorded = 1;
	return 0;
}

int cudaEventQuery(void *event)
{
	return ((struct event *)event)->recorded ? 0 : 600; /* cudaErrorNotReady */
}

int cudaEventElapsedTime(float *ms, void *start, void *end)
{
	*ms = (float)(((struct event *)end)->t_ms - ((struct event *)start)->t_ms);
	return 0;
}

int cudaEventDestroy(void *event)
{
	free(event);
	return 0;
}
