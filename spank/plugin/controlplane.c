/*
 * The job's control plane (greyhound/control/launch.py): the process that remote.c
 * starts from the batch task, once per job, just before the batch script is exec'd.
 *
 * The child is forked from the batch task itself, so that it is a child of the batch
 * script: Slurm's process tracking ends it with the job (proctrack/linuxproc follows
 * parent pids; no double fork, no setsid). It must leave the task exactly as it was:
 *   - the task: no signal handler, no fd and no child left to the user's script but
 *     the launcher itself (which the script reaps like any child of its own);
 *   - the child: default signal dispositions and an empty mask (not slurmstepd's),
 *     stdin from /dev/null (never the task's), stdout/stderr the job's, no other fd;
 *     SIGTERM when the batch script ends (PR_SET_PDEATHSIG: once the script has gone
 *     the launcher is no longer below the step's slurmstepd, so proctrack/linuxproc
 *     would not find it);
 *   - its environment: the task's, with greyhound's own entries taken off LD_PRELOAD
 *     and PYTHONPATH (the user's values as they were) and GREYHOUND_CONTROL_PLANE=1,
 *     so that neither it nor the srun step it starts is recorded into rings.
 * Whether the exec worked comes back over a close-on-exec pipe, so that a failure is
 * one line at once and the failed child is reaped here, not left to the script.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "greyhound.h"

#define CLOSE_FDS_FALLBACK_MAX 65536 /* without close_range: close up to this many fds */

enum child_stage { STAGE_STDIN = 1, STAGE_EXEC = 2 };

struct child_status {
	int stage;
	int err;
};

static int is_var(const char *assignment, const char *name)
{
	size_t len = strlen(name);

	return !strncmp(assignment, name, len) && assignment[len] == '=';
}

/*
 * One variable of the launcher's environment: NULL to leave it out, else the string
 * to use (assignment itself, or a new one in *owned that the caller frees).
 */
static const char *edit_var(const char *assignment, const char *name, const char *entry, char **owned)
{
	const char *value = assignment + strlen(name) + 1, *rest;

	if (entry == NULL || entry[0] == '\0')
		return assignment;
	if ((rest = gh_path_unprepend(entry, value)) == NULL)
		return NULL;
	if (rest == value)
		return assignment;
	if (asprintf(owned, "%s=%s", name, rest) < 0) {
		*owned = NULL;
		return assignment; /* out of memory: the hook's own check still passes it through */
	}
	return *owned;
}

/*
 * The launcher's environment (see the file's comment); NULL when out of memory.
 * owned[0..1] receive the strings made here, freed with the array by free_env.
 */
static char **launcher_env(char *const *job_env, const char *hook, const char *capture, char *owned[2])
{
	size_t n = 0, used = 0;
	char **env;

	owned[0] = owned[1] = NULL;
	while (job_env && job_env[n])
		n++;
	if ((env = calloc(n + 2, sizeof(*env))) == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		const char *value = job_env[i];

		if (is_var(value, GH_CONTROL_PLANE_ENV))
			continue;
		if (is_var(value, "LD_PRELOAD"))
			value = edit_var(value, "LD_PRELOAD", hook, &owned[0]);
		else if (is_var(value, "PYTHONPATH"))
			value = edit_var(value, "PYTHONPATH", capture, &owned[1]);
		if (value)
			env[used++] = (char *)value;
	}
	env[used++] = GH_CONTROL_PLANE_ENV "=1";
	env[used] = NULL;
	return env;
}

/* Closes every fd from lowest up except keep (keep >= lowest). */
static void close_fds_from(int lowest, int keep)
{
	struct rlimit lim;
	long max = CLOSE_FDS_FALLBACK_MAX;

#ifdef SYS_close_range
	if ((keep == lowest || syscall(SYS_close_range, lowest, keep - 1, 0) == 0) &&
	    syscall(SYS_close_range, keep + 1, ~0U, 0) == 0)
		return;
#endif
	/* Before Linux 5.9: one by one, up to the fd limit. */
	if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && (long)lim.rlim_cur < max)
		max = (long)lim.rlim_cur;
	for (long fd = lowest; fd < max; fd++) {
		if (fd != keep)
			close((int)fd);
	}
}

/* A task whose stdin, stdout or stderr is closed: the pipe must not take their place. */
static int move_above_stdio(int *fd)
{
	int moved;

	if (*fd > STDERR_FILENO)
		return 0;
	if ((moved = fcntl(*fd, F_DUPFD_CLOEXEC, STDERR_FILENO + 1)) < 0)
		return -1;
	close(*fd);
	*fd = moved;
	return 0;
}

/* In the child: only async-signal-safe calls from here to exec. Never returns. */
static void __attribute__((noreturn))
exec_launcher(const char *python, char *const argv[], char *const envp[], pid_t parent, int status_fd)
{
	struct child_status status = { STAGE_STDIN, 0 };
	sigset_t none;
	int fd;

	/* Best effort: without it the launcher still ends when the job's steps end. */
	if (prctl(PR_SET_PDEATHSIG, SIGTERM) == 0 && getppid() != parent)
		_exit(0); /* the batch script has already ended */
	for (int sig = 1; sig < NSIG; sig++) {
		if (sig != SIGKILL && sig != SIGSTOP)
			signal(sig, SIG_DFL);
	}
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	if ((fd = open("/dev/null", O_RDONLY)) < 0 || (fd != STDIN_FILENO && dup2(fd, STDIN_FILENO) < 0))
		goto fail;
	close_fds_from(STDERR_FILENO + 1, status_fd);
	status.stage = STAGE_EXEC;
	execve(python, argv, envp);
fail:
	status.err = errno;
	if (write(status_fd, &status, sizeof(status)) != (ssize_t)sizeof(status))
		_exit(126); /* the parent then takes it as started; the launcher says nothing */
	_exit(127);
}

int gh_control_plane_start(const char *python, char *const *job_env, const char *hook, const char *capture,
			   pid_t *pid_out, char *err, size_t err_len)
{
	char *const argv[] = { (char *)python, "-I", "-m", "greyhound.control.launch", NULL };
	struct child_status status = { 0, 0 };
	char **env = NULL, *owned[2] = { NULL, NULL };
	int pipe_fds[2] = { -1, -1 }, rv = -1;
	pid_t parent = getpid(), pid;
	ssize_t n;

	if ((env = launcher_env(job_env, hook, capture, owned)) == NULL) {
		snprintf(err, err_len, "out of memory");
		goto fail;
	}
	if (pipe2(pipe_fds, O_CLOEXEC) < 0 || move_above_stdio(&pipe_fds[0]) < 0 || move_above_stdio(&pipe_fds[1]) < 0) {
		snprintf(err, err_len, "pipe: %s", strerror(errno));
		goto fail;
	}
	if ((pid = fork()) < 0) {
		snprintf(err, err_len, "fork: %s", strerror(errno));
		goto fail;
	}
	if (pid == 0)
		exec_launcher(python, argv, env, parent, pipe_fds[1]);
	close(pipe_fds[1]);
	pipe_fds[1] = -1;
	do
		n = read(pipe_fds[0], &status, sizeof(status));
	while (n < 0 && errno == EINTR);
	if (n == (ssize_t)sizeof(status)) {
		/* It exits at once: reaped here, so the script never sees it. */
		while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
			;
		if (status.stage == STAGE_STDIN)
			snprintf(err, err_len, "/dev/null: %s", strerror(status.err));
		else
			snprintf(err, err_len, "python=%s: %s", python, strerror(status.err));
		goto fail;
	}
	/* EOF: the exec worked (the pipe closed on it). */
	*pid_out = pid;
	rv = 0;
fail:
	if (pipe_fds[0] >= 0)
		close(pipe_fds[0]);
	if (pipe_fds[1] >= 0)
		close(pipe_fds[1]);
	free(owned[0]);
	free(owned[1]);
	free(env);
	return rv;
}
