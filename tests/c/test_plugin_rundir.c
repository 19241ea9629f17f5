/*
 * Unit test of the run directories (spank/plugin/rundir.c): rundir= checks, a fresh job
 * directory for a reused job id, rings removed at job end, retention, and removal that
 * never follows what a user planted. Needs root (chown, root-owned parents). Built with
 * ASan/UBSan by tests/test_plugin_config.py; argv[1] is an empty root-owned 0700 work
 * directory. Prints "N passed, N failed".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "greyhound.h"

static int passed, failed;
static char base[PATH_MAX / 2];

#define CHECK(cond)                                                                     \
	do {                                                                            \
		if (cond) {                                                             \
			passed++;                                                       \
		} else {                                                                \
			failed++;                                                       \
			fprintf(stderr, "FAIL %s:%d: %s (err: %s)\n", __FILE__, __LINE__, #cond, err); \
		}                                                                       \
	} while (0)

static const char *at(const char *rel)
{
	static char paths[8][PATH_MAX];
	static int next;
	char *p = paths[next++ % 8];

	snprintf(p, PATH_MAX, "%s/%s", base, rel);
	return p;
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
		perror(path);
		exit(2);
	}
}

static int exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

static int is_file_with(const char *path, const char *text)
{
	char buf[256] = "";
	FILE *f = fopen(path, "r");
	size_t n;

	if (!f)
		return 0;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	return !strcmp(buf, text);
}

static void age(const char *path, time_t seconds)
{
	struct timespec times[2] = { { time(NULL) - seconds, 0 }, { time(NULL) - seconds, 0 } };

	if (utimensat(AT_FDCWD, path, times, AT_SYMLINK_NOFOLLOW) < 0) {
		perror(path);
		exit(2);
	}
}

/* A user's planted mess in dir: symlinks out, a hard link out, a fifo, a deep tree. */
static void plant(const char *dir)
{
	char path[PATH_MAX], deep[PATH_MAX];
	int n;

	snprintf(path, sizeof(path), "%s/link-to-file", dir);
	if (symlink(at("outside/secret"), path) < 0)
		exit(2);
	snprintf(path, sizeof(path), "%s/link-to-dir", dir);
	if (symlink(at("outside"), path) < 0)
		exit(2);
	snprintf(path, sizeof(path), "%s/hardlink", dir);
	if (link(at("outside/secret"), path) < 0)
		exit(2);
	snprintf(path, sizeof(path), "%s/fifo", dir);
	if (mkfifo(path, 0600) < 0)
		exit(2);
	n = snprintf(deep, sizeof(deep), "%s/deep", dir);
	for (int i = 0; i < 100 && n + 3 < (int)sizeof(deep); i++) {
		if (mkdir(deep, 0700) < 0)
			exit(2);
		n += snprintf(deep + n, sizeof(deep) - n, "/d");
	}
}

static int outside_intact(void)
{
	return is_file_with(at("outside/secret"), "root's\n") && is_file_with(at("outside/keep"), "keep\n");
}

/* rundir=: made if missing, refused where a user could plant or swap it. */
static void test_rundir_checks(void)
{
	char err[GH_ERR_LEN] = "";
	struct stat st;
	int fd;

	fd = gh_rundir_open(at("made/by/us"), 1, err, sizeof(err));
	CHECK(fd >= 0 && fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 07777) == 0755 && st.st_uid == 0);
	CHECK(stat(at("made/by"), &st) == 0 && (st.st_mode & 07777) == 0755);
	close(fd);
	errno = 0;
	CHECK(gh_rundir_open(at("missing"), 0, err, sizeof(err)) < 0 && errno == ENOENT);

	CHECK(mkdir(at("real"), 0755) == 0 && symlink(at("real"), at("link")) == 0);
	CHECK(gh_rundir_open(at("link"), 1, err, sizeof(err)) < 0 && strstr(err, "/link is a symlink; allowed: a real directory"));
	CHECK(gh_rundir_open(at("link/rundir"), 1, err, sizeof(err)) < 0 && strstr(err, "/link is a symlink") &&
	      !exists(at("real/rundir")));
	write_file(at("file"), "");
	CHECK(gh_rundir_open(at("file"), 1, err, sizeof(err)) < 0 && strstr(err, "/file is not a directory"));

	CHECK(mkdir(at("users"), 0755) == 0 && chown(at("users"), 65534, 65534) == 0);
	CHECK(gh_rundir_open(at("users"), 1, err, sizeof(err)) < 0 && strstr(err, "/users is not owned by root"));
	CHECK(gh_rundir_open(at("users/rundir"), 1, err, sizeof(err)) < 0 && strstr(err, "/users is not owned by root") &&
	      !exists(at("users/rundir")));
	CHECK(mkdir(at("open"), 0755) == 0 && chmod(at("open"), 0777) == 0);
	CHECK(gh_rundir_open(at("open/rundir"), 1, err, sizeof(err)) < 0 &&
	      strstr(err, "/open is writable by group or others without the sticky bit (mode 0777"));
	CHECK(gh_rundir_open(at("open"), 1, err, sizeof(err)) < 0 && strstr(err, "/open is writable by group or others"));
	/* Like /var/tmp: a sticky, world-writable parent is fine; the rundir itself is not. */
	CHECK(mkdir(at("tmp"), 0755) == 0 && chmod(at("tmp"), 01777) == 0);
	CHECK((fd = gh_rundir_open(at("tmp/greyhound"), 1, err, sizeof(err))) >= 0);
	close(fd);
	CHECK(gh_rundir_open(at("tmp"), 1, err, sizeof(err)) < 0 && strstr(err, "writable by group or others"));
	/* A user who got there first (/var/tmp/greyhound as their own directory or a symlink). */
	CHECK(mkdir(at("tmp/squatted"), 0755) == 0 && chown(at("tmp/squatted"), 65534, 65534) == 0);
	CHECK(gh_rundir_open(at("tmp/squatted"), 1, err, sizeof(err)) < 0 && strstr(err, "is not owned by root"));
	CHECK(symlink(at("real"), at("tmp/planted")) == 0 && lchown(at("tmp/planted"), 65534, 65534) == 0);
	CHECK(gh_rundir_open(at("tmp/planted"), 1, err, sizeof(err)) < 0 && strstr(err, "is a symlink"));
}

/* A job's run directory: made for the job's user, kept for its other steps, and its
 * files never written through a planted symlink. */
static void test_job_directory(int rd)
{
	char err[GH_ERR_LEN] = "left over"; /* a success clears what an earlier failure left */
	struct stat st, st2;
	int fd, job_fd;

	job_fd = gh_job_dir_prepare(rd, 41, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(job_fd >= 0 && fstat(job_fd, &st) == 0 && st.st_uid == 65534 && st.st_gid == 65534 &&
	      (st.st_mode & 07777) == 0700 && err[0] == '\0');
	/* Another step of the same job: the same directory, contents kept. */
	write_file(at("rd/41/timeline"), "t\n");
	fd = gh_job_dir_prepare(rd, 41, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && fstat(fd, &st2) == 0 && st2.st_ino == st.st_ino && exists(at("rd/41/timeline")));
	close(fd);

	/* options: a planted symlink is replaced, never written through. */
	CHECK(symlink(at("outside/keep"), at("rd/41/options")) == 0);
	CHECK(gh_job_file_write(job_fd, "options", "mode=detect\n", 65534, 65534, err, sizeof(err)) == 0);
	CHECK(is_file_with(at("rd/41/options"), "mode=detect\n") && lstat(at("rd/41/options"), &st) == 0 &&
	      S_ISREG(st.st_mode) && st.st_uid == 65534 && (st.st_mode & 07777) == 0600 && outside_intact());
	close(job_fd);
}

static void test_reused_job_ids(int rd)
{
	char err[GH_ERR_LEN] = "";
	struct stat st;
	int fd;

	/* A reused job id: another user's old directory (with their trace) is not handed over. */
	CHECK(mkdir(at("rd/42"), 0700) == 0 && chown(at("rd/42"), 12345, 12345) == 0);
	write_file(at("rd/42/trace.h5"), "old\n");
	plant(at("rd/42"));
	fd = gh_job_dir_prepare(rd, 42, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && fstat(fd, &st) == 0 && st.st_uid == 65534 && !exists(at("rd/42/trace.h5")) &&
	      !exists(at("rd/42/link-to-file")) && outside_intact());
	close(fd);
	/* The same user's, from a job with the same id that ended hours ago: fresh too. */
	CHECK(mkdir(at("rd/43"), 0700) == 0 && chown(at("rd/43"), 65534, 65534) == 0);
	write_file(at("rd/43/trace.h5"), "old\n");
	write_file(at("rd/43.end"), "");
	age(at("rd/43.end"), 2 * 3600);
	fd = gh_job_dir_prepare(rd, 43, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && !exists(at("rd/43/trace.h5")) && !exists(at("rd/43.end")));
	close(fd);
	/* A requeued run of the job (its id back within the hour) goes on in its directory. */
	CHECK(mkdir(at("rd/45"), 0700) == 0 && chown(at("rd/45"), 65534, 65534) == 0);
	write_file(at("rd/45/events.jsonl"), "{}\n");
	write_file(at("rd/45.end"), "");
	age(at("rd/45.end"), 100);
	fd = gh_job_dir_prepare(rd, 45, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && is_file_with(at("rd/45/events.jsonl"), "{}\n") && !exists(at("rd/45.end")));
	close(fd);
	/* ... but never another user's. */
	CHECK(mkdir(at("rd/46"), 0700) == 0 && chown(at("rd/46"), 12345, 12345) == 0);
	write_file(at("rd/46/events.jsonl"), "{}\n");
	write_file(at("rd/46.end"), "");
	fd = gh_job_dir_prepare(rd, 46, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && fstat(fd, &st) == 0 && st.st_uid == 65534 && !exists(at("rd/46/events.jsonl")));
	close(fd);
	/* Not a directory where the job's directory goes. */
	CHECK(symlink(at("outside"), at("rd/44")) == 0);
	fd = gh_job_dir_prepare(rd, 44, 65534, 65534, time(NULL), err, sizeof(err));
	CHECK(fd >= 0 && lstat(at("rd/44"), &st) == 0 && S_ISDIR(st.st_mode) && outside_intact());
	close(fd);
}

/* Job end: rings go, the rest stays. */
static void test_job_end(int rd)
{
	char err[GH_ERR_LEN] = "";
	struct stat st;

	write_file(at("rd/41/ring.0"), "r");
	write_file(at("rd/41/ring.1.7"), "r");
	CHECK(symlink(at("outside/secret"), at("rd/41/ring.2")) == 0);
	CHECK(mkdir(at("rd/41/ring.dir"), 0700) == 0 && symlink(at("outside"), at("rd/41/ring.dir/out")) == 0);
	CHECK(mkdir(at("rd/41/report"), 0700) == 0);
	CHECK(gh_job_dir_end(rd, 41, err, sizeof(err)) == 1);
	CHECK(!exists(at("rd/41/ring.0")) && !exists(at("rd/41/ring.1.7")) && !exists(at("rd/41/ring.2")) &&
	      !exists(at("rd/41/ring.dir")) && exists(at("rd/41/timeline")) && exists(at("rd/41/options")) &&
	      exists(at("rd/41/report")) && exists(at("rd/41.end")) && outside_intact());
	CHECK(gh_job_dir_end(rd, 99, err, sizeof(err)) == 0 && !exists(at("rd/99.end")));
	/* The mark keeps the first end's time (another node ending later does not extend it). */
	age(at("rd/41.end"), 1000);
	CHECK(gh_job_dir_end(rd, 41, err, sizeof(err)) == 1 && stat(at("rd/41.end"), &st) == 0 &&
	      st.st_mtime <= time(NULL) - 999);
}

/* Retention: expired job directories and leftover trash go, and removal never follows
 * a symlink. */
static void test_retention(int rd)
{
	char err[GH_ERR_LEN] = "", path[PATH_MAX];
	struct stat st;

	plant(at("rd/41"));
	age(at("rd/41.end"), 8 * 86400); /* ended 8 days ago: expired under retain=7 */
	CHECK(gh_job_dir_end(rd, 42, err, sizeof(err)) == 1);
	age(at("rd/42.end"), 6 * 86400); /* 6 days: kept */
	/* 43: no mark (still running, or its node never ran the epilog): kept */
	CHECK(mkdir(at("rd/.trash.0123456789abcdef"), 0700) == 0);
	plant(at("rd/.trash.0123456789abcdef"));
	age(at("rd/.trash.0123456789abcdef"), 7200);
	CHECK(gh_rundir_sweep(rd, 7, time(NULL), err, sizeof(err)) == 1);
	CHECK(!exists(at("rd/41")) && !exists(at("rd/41.end")) && exists(at("rd/42")) && exists(at("rd/42.end")) &&
	      exists(at("rd/43")) && !exists(at("rd/.trash.0123456789abcdef")) && outside_intact());
	/* retain=0: everything at the next sweep, but not before the post-mortem's grace hour. */
	age(at("rd/42.end"), 600);
	CHECK(gh_rundir_sweep(rd, 0, time(NULL), err, sizeof(err)) == 0 && exists(at("rd/42")));
	age(at("rd/42.end"), 3700);
	CHECK(gh_rundir_sweep(rd, 0, time(NULL), err, sizeof(err)) == 1 && !exists(at("rd/42")));
	/* A removal never follows a symlink, even as the tree's own name. */
	snprintf(path, sizeof(path), "%s", at("rd/link"));
	CHECK(symlink(at("outside"), path) == 0 && gh_remove_tree_at(rd, "link") == 0 && !exists(path) &&
	      outside_intact());
	CHECK(gh_remove_tree_at(rd, "no-such-entry") == 0);
	CHECK(stat(at("outside/secret"), &st) == 0 && st.st_nlink == 1); /* the hard links went, the file stayed */
}

int main(int argc, char **argv)
{
	char err[GH_ERR_LEN] = "";
	int rd;

	if (argc != 2 || geteuid() != 0) {
		fprintf(stderr, "usage (as root): %s EMPTY_DIR\n", argv[0]);
		return 2;
	}
	snprintf(base, sizeof(base), "%s", argv[1]);
	if (mkdir(at("outside"), 0755) < 0)
		return 2;
	write_file(at("outside/secret"), "root's\n");
	write_file(at("outside/keep"), "keep\n");

	test_rundir_checks();

	/* --- a job's run directory ------------------------------------------------------ */
	rd = gh_rundir_open(at("rd"), 1, err, sizeof(err));
	CHECK(rd >= 0);
	test_job_directory(rd);
	test_reused_job_ids(rd);
	test_job_end(rd);
	test_retention(rd);
	close(rd);

	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
