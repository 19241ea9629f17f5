/*
 * The hook's clock (spank/hook/clock.c, compiled in) read by THREADS threads at
 * once for SECONDS, while the line is refitted under them: THREADS SECONDS ALLOW_TSC.
 *
 * Each reading is bracketed by clock_gettime(CLOCK_MONOTONIC). Prints
 * "readings R backwards B early E late L tsc T": readings that went back on
 * their thread (must be 0), the largest amount by which a reading fell before
 * its bracket or after it (ns), and whether the TSC line was in use at the end.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "clock.c"

struct gh_ring_header *gh_hdr; /* no ring: clock.c only flags it when there is one */

static double seconds;

struct result {
	long readings, backwards;
	long long early, late;
};

static void *reader(void *arg)
{
	struct result *r = arg;
	uint64_t prev = 0, start = gh_mono_ns();

	while (gh_mono_ns() - start < (uint64_t)(seconds * 1e9)) {
		for (int i = 0; i < 1000; i++) {
			uint64_t before = gh_mono_ns();
			uint64_t t = gh_now_ns();
			uint64_t after = gh_mono_ns();

			if (t < prev)
				r->backwards++;
			if ((long long)(before - t) > r->early)
				r->early = (long long)(before - t);
			if ((long long)(t - after) > r->late)
				r->late = (long long)(t - after);
			prev = t;
			r->readings++;
		}
	}
	return NULL;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 4;
	pthread_t th[64];
	struct result res[64] = { { 0 } }, total = { 0 };

	seconds = argc > 2 ? atof(argv[2]) : 1.0;
	if (n < 1 || n > 64)
		return 2;
	gh_clock_init(argc > 3 ? atoi(argv[3]) : 1);
	for (int i = 0; i < n; i++)
		if (pthread_create(&th[i], NULL, reader, &res[i]) != 0)
			return 1;
	for (int i = 0; i < n; i++) {
		pthread_join(th[i], NULL);
		total.readings += res[i].readings;
		total.backwards += res[i].backwards;
		if (res[i].early > total.early)
			total.early = res[i].early;
		if (res[i].late > total.late)
			total.late = res[i].late;
	}
	printf("readings %ld backwards %ld early %lld late %lld tsc %d\n", total.readings,
	       total.backwards, total.early, total.late,
	       gh_clock.mode == GH_CLOCK_TSC && gh_clock.mult != 0);
	return 0;
}
