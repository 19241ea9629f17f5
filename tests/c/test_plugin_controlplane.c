/*
 * Unit test of gh_control_plane_start (spank/plugin/controlplane.c): the launcher is
 * started with the right command, environment, stdin, fds and signal state, and the
 * caller (the batch task, about to become the user's script) is left exactly as it
 * was. Built with ASan/UBSan by tests/test_plugin_config.py. Prints "N passed, N failed".
 *
 * The binary plays the launcher too: started as "<self> -I -m greyhound.control.launch"
 * it writes what it sees to $GH_TEST_REPORT and exits.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "greyhound.h"

static int passed, failed;

#define CHECK(cond)                                                           \
	do {                                                                  \
		if (cond) {                                                   \
			passed++;                                             \
		} else {                                                      \
			failed++;                                             \
			fprintf(stderr, "FAIL line %d: %s\n", __LINE__, #cond); \
		}                                                             \
	} while (0)

/* The fds open in this process, as "0,1,2,"; the listing's own fd left out. */
static void open_fds(char *out, size_t out_len)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	size_t used = 0;

	out[0] = '\0';
	if (!d)
		return;
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d))
			continue;
		used += (size_t)snprintf(out + used, out_len - used, "%s,", e->d_name);
	}
	closedir(d);
}

static void status_field(const char *name, char *out, size_t out_len)
{
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];

	out[0] = '\0';
	while (f && fgets(line, sizeof(line), f)) {
		if (!strncmp(line, name, strlen(name))) {
			snprintf(out, out_len, "%s", line + strlen(name) + strspn(line + strlen(name), " \t"));
			out[strcspn(out, " \t\n")] = '\0';
		}
	}
	if (f)
		fclose(f);
}

static int launcher(int argc, char **argv)
{
	const char *report = getenv("GH_TEST_REPORT");
	char fds[256], stdin_target[256] = "", sig_ign[64], sig_blk[64];
	int pdeathsig = 0;
	ssize_t n;
	FILE *f;

	open_fds(fds, sizeof(fds)); /* first: before this opens anything */
	if (!report || !(f = fopen(report, "w")))
		return 1;
	n = readlink("/proc/self/fd/0", stdin_target, sizeof(stdin_target) - 1);
	stdin_target[n > 0 ? n : 0] = '\0';
	status_field("SigIgn:", sig_ign, sizeof(sig_ign));
	status_field("SigBlk:", sig_blk, sizeof(sig_blk));
	prctl(PR_GET_PDEATHSIG, &pdeathsig);
	fprintf(f, "argc=%d\nargs=%s %s %s\n", argc, argv[1], argv[2], argv[3]);
	fprintf(f, "fds=%s\nstdin=%s\nsigign=%s\nsigblk=%s\npdeathsig=%d\nppid=%ld\n", fds, stdin_target, sig_ign,
		sig_blk, pdeathsig, (long)getppid());
	fprintf(f, "LD_PRELOAD=%s\nPYTHONPATH=%s\nplane=%s\nkeep=%s\n", getenv("LD_PRELOAD") ?: "<unset>",
		getenv("PYTHONPATH") ?: "<unset>", getenv(GH_CONTROL_PLANE_ENV) ?: "<unset>",
		getenv("KEEP") ?: "<unset>");
	fclose(f);
	return 0;
}

static int report_has(const char *report, const char *line)
{
	char buf[4096];
	FILE *f = fopen(report, "r");
	size_t n;

	if (!f)
		return 0;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	if (!strstr(buf, line))
		fprintf(stderr, "report lacks '%s':\n%s", line, buf);
	return strstr(buf, line) != NULL;
}

static int no_child_left(void)
{
	return waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD;
}

/* The test's files: this binary (the launcher too), its report and the temporary
 * directory they live in. */
struct paths {
	char self[4096], report[4096], report_env[4096 + 32];
	char dir[sizeof("/tmp/gh-controlplane-XXXXXX")], plain[64];
};

/* The launcher started from a task with state of its own (an fd not close-on-exec, a
 * pipe as stdin, an ignored and a blocked signal) gets none of it, and the caller
 * keeps all of it. */
static void test_launcher_gets_a_clean_start(const struct paths *p)
{
	char fds_before[256], fds_after[256], line[64], err[GH_ERR_LEN];
	struct sigaction ignore = { .sa_handler = SIG_IGN }, got;
	sigset_t usr2, mask;
	pid_t pid = 0;
	int status, stdin_pipe[2], saved_stdin;

	if (pipe(stdin_pipe) < 0 || (saved_stdin = dup(STDIN_FILENO)) < 0 || dup2(stdin_pipe[0], STDIN_FILENO) < 0)
		exit(2);
	close(stdin_pipe[0]); /* the task's stdin is a pipe now (the job's input) */
	sigaction(SIGUSR1, &ignore, NULL);
	sigemptyset(&usr2);
	sigaddset(&usr2, SIGUSR2);
	sigprocmask(SIG_BLOCK, &usr2, NULL);
	open_fds(fds_before, sizeof(fds_before));
	{
		char *job_env[] = { "LD_PRELOAD=/gh/lib/libgreyhound_hook.so", "PYTHONPATH=/gh/python:/user/py::/x",
				    "GREYHOUND_CONTROL_PLANE=0", (char *)p->report_env, "KEEP=a=b", NULL };

		CHECK(gh_control_plane_start(p->self, job_env, "/gh/lib/libgreyhound_hook.so", "/gh/python", &pid, err,
					     sizeof(err)) == 0);
	}
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK(report_has(p->report, "argc=4\nargs=-I -m greyhound.control.launch\n"));
	/* Only stdin (from /dev/null), stdout and stderr: not the task's other fds. */
	CHECK(report_has(p->report, "fds=0,1,2,\nstdin=/dev/null\n"));
	CHECK(report_has(p->report, "sigign=0000000000000000\nsigblk=0000000000000000\n"));
	CHECK(report_has(p->report, "pdeathsig=15\n"));
	snprintf(line, sizeof(line), "ppid=%ld\n", (long)getpid());
	CHECK(report_has(p->report, line)); /* a child of the task (the script-to-be), no double fork */
	/* greyhound's entries off the search paths, the user's values as they were. */
	CHECK(report_has(p->report, "LD_PRELOAD=<unset>\nPYTHONPATH=/user/py::/x\nplane=1\nkeep=a=b\n"));

	/* The caller is as it was: its fds, its ignored and blocked signals, no child. */
	open_fds(fds_after, sizeof(fds_after));
	CHECK(!strcmp(fds_before, fds_after));
	CHECK(sigaction(SIGUSR1, NULL, &got) == 0 && got.sa_handler == SIG_IGN);
	CHECK(sigaction(SIGCHLD, NULL, &got) == 0 && got.sa_handler == SIG_DFL);
	CHECK(sigprocmask(SIG_BLOCK, NULL, &mask) == 0 && sigismember(&mask, SIGUSR2) == 1);
	CHECK(no_child_left());
	dup2(saved_stdin, STDIN_FILENO);
	close(saved_stdin);
	close(stdin_pipe[1]);
}

/* Variables that are not greyhound's entry are left alone. */
static void test_other_entries_left_alone(const struct paths *p)
{
	char *job_env[] = { "PYTHONPATH=/user/py", (char *)p->report_env, NULL };
	char err[GH_ERR_LEN];
	pid_t pid = 0;
	int status;

	unlink(p->report);
	CHECK(gh_control_plane_start(p->self, job_env, "", "/gh/python", &pid, err, sizeof(err)) == 0);
	CHECK(waitpid(pid, &status, 0) == pid && report_has(p->report, "PYTHONPATH=/user/py\nplane=1\n"));
}

/* A python= that cannot run: -1 with the cause, the failed child reaped here, and
 * the fds as they were in `fds_before`. */
static void test_python_that_cannot_run(const struct paths *p, const char *fds_before)
{
	char fds_after[256], err[GH_ERR_LEN];
	pid_t pid = 0;
	int plain;

	CHECK(gh_control_plane_start("/nonexistent/python", (char *[]){ NULL }, "", "", &pid, err, sizeof(err)) < 0 &&
	      !strcmp(err, "python=/nonexistent/python: No such file or directory"));
	CHECK(no_child_left());
	plain = open(p->plain, O_WRONLY | O_CREAT | O_EXCL, 0644);
	close(plain);
	CHECK(gh_control_plane_start(p->plain, (char *[]){ NULL }, "", "", &pid, err, sizeof(err)) < 0 &&
	      strstr(err, ": Permission denied") != NULL);
	CHECK(no_child_left());
	open_fds(fds_after, sizeof(fds_after));
	CHECK(!strcmp(fds_before, fds_after));
}

/* A task with stdin closed: the launcher still gets /dev/null as its stdin. */
static void test_closed_stdin(const struct paths *p)
{
	char *job_env[] = { (char *)p->report_env, NULL };
	char err[GH_ERR_LEN];
	pid_t pid = 0;
	int status, saved = dup(STDIN_FILENO);

	unlink(p->report);
	close(STDIN_FILENO);
	CHECK(gh_control_plane_start(p->self, job_env, "", "", &pid, err, sizeof(err)) == 0);
	CHECK(fcntl(STDIN_FILENO, F_GETFD) < 0); /* still closed here */
	dup2(saved, STDIN_FILENO);
	close(saved);
	CHECK(waitpid(pid, &status, 0) == pid && report_has(p->report, "fds=0,1,2,\nstdin=/dev/null\n"));
}

int main(int argc, char **argv)
{
	static struct paths p = { .dir = "/tmp/gh-controlplane-XXXXXX" };
	char fds[256];
	int leaked_fd;
	ssize_t n;

	if (argc == 4 && !strcmp(argv[1], "-I"))
		return launcher(argc, argv);
	if ((n = readlink("/proc/self/exe", p.self, sizeof(p.self) - 1)) < 0 || !mkdtemp(p.dir))
		return 2;
	p.self[n] = '\0';
	snprintf(p.report, sizeof(p.report), "%s/report", p.dir);
	snprintf(p.report_env, sizeof(p.report_env), "GH_TEST_REPORT=%s", p.report);
	snprintf(p.plain, sizeof(p.plain), "%s/plain", p.dir);

	/* The task's state that must reach neither the launcher nor change here. */
	leaked_fd = open("/dev/zero", O_RDONLY); /* not close-on-exec */
	test_launcher_gets_a_clean_start(&p);
	open_fds(fds, sizeof(fds));
	test_other_entries_left_alone(&p);
	test_python_that_cannot_run(&p, fds);
	test_closed_stdin(&p);

	close(leaked_fd);
	unlink(p.report);
	unlink(p.plain);
	rmdir(p.dir);
	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
