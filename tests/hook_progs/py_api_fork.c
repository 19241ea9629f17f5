/*
 * The hook's Python-capture entry points (gh_py_begin, gh_py_end_head), found
 * with dlsym in the preloaded hook, called N times before and after a fork(),
 * and N times in the child: N.
 *
 * Each call is bracketed by CLOCK_MONOTONIC; prints "pid comm before after" per
 * call so a test can match every record to its bracket. The parent records on
 * comm 7, the child on comm 8: the child must get its own ring (and its own
 * clock state) and never write into the parent's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct head {
	uint32_t op, flags;
	int32_t peer;
	uint32_t reserved;
	uint64_t comm_id, size_bytes, req_id;
};

static uintptr_t (*begin)(void);
static uint64_t (*end_head)(const void *);

static long long now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void calls(int n, uint64_t comm)
{
	for (int i = 0; i < n; i++) {
		struct head h = { .op = 1, .peer = -1, .comm_id = comm, .size_bytes = (uint64_t)i };
		long long before = now(), after;

		if (!begin())
			exit(3);
		end_head(&h);
		after = now();
		printf("%d %llu %lld %lld\n", (int)getpid(), (unsigned long long)comm, before, after);
		if (i % 50 == 49) {
			struct timespec nap = { 0, 2000000 };

			nanosleep(&nap, NULL); /* spread over a few refits of the TSC line */
		}
	}
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 200, status;
	pid_t pid;

	begin = (uintptr_t(*)(void))dlsym(RTLD_DEFAULT, "gh_py_begin");
	end_head = (uint64_t(*)(const void *))dlsym(RTLD_DEFAULT, "gh_py_end_head");
	if (!begin || !end_head)
		return 2;
	calls(n, 7);
	fflush(stdout);
	pid = fork();
	if (pid < 0)
		return 1;
	if (pid == 0) {
		calls(n, 8);
		fflush(stdout);
		_exit(0);
	}
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		return 1;
	calls(n, 7);
	return 0;
}
