/*
 * MPI_Allreduce in a loop, each call bracketed by CLOCK_MONOTONIC and
 * CLOCK_REALTIME readings: OUT_FILE ITERATIONS NAP_EVERY NAP_US.
 *
 * Writes one line per call, "mono_before mono_after real_before real_after"
 * (ns), so that tests/test_hook_clock.py can check the hook's timestamps
 * against the system clocks. Every NAP_EVERY calls it sleeps NAP_US, so the
 * run spans a few seconds and the hook refits its TSC line several times.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long ns(clockid_t id)
{
	struct timespec t;

	clock_gettime(id, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv)
{
	long n, every, nap_us;
	long long(*rows)[4];
	double in = 1, out = 0;
	FILE *f;

	if (argc != 5)
		return 2;
	n = atol(argv[2]);
	every = atol(argv[3]);
	nap_us = atol(argv[4]);
	rows = calloc((size_t)n, sizeof(*rows));
	if (!rows)
		return 1;
	MPI_Init(&argc, &argv);
	for (long i = 0; i < n; i++) {
		if (every > 0 && i % every == every - 1) {
			struct timespec nap = { nap_us / 1000000, (nap_us % 1000000) * 1000 };

			nanosleep(&nap, NULL);
		}
		rows[i][0] = ns(CLOCK_MONOTONIC);
		rows[i][2] = ns(CLOCK_REALTIME);
		MPI_Allreduce(&in, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
		rows[i][3] = ns(CLOCK_REALTIME);
		rows[i][1] = ns(CLOCK_MONOTONIC);
	}
	MPI_Finalize();
	f = fopen(argv[1], "w");
	if (!f)
		return 1;
	for (long i = 0; i < n; i++)
		fprintf(f, "%lld %lld %lld %lld\n", rows[i][0], rows[i][1], rows[i][2], rows[i][3]);
	free(rows);
	return fclose(f) == 0 ? 0 : 1;
}
