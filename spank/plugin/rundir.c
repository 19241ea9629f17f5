/*
 * The run directories, made and removed as root by file descriptor, never by path.
 *
 * rundir= (the admin's parent of the run directories) must be a real directory owned
 * by root and not writable by group or others, reached from / through root-owned
 * directories (writable by others only with the sticky bit, like /var/tmp) with no
 * symlink on the way: then only root can add, rename or remove its entries, and
 * nothing a user plants (in /var/tmp, in their own run directory) can redirect what
 * root does here. Inside it:
 *
 *   <jobid>/        a job's run directory: owned by the job's user, mode 0700; the
 *                   hook's rings (ring.*), the timeline, the options file, the report
 *   <jobid>.end     root's mark that job <jobid> has ended (empty; its mtime says when):
 *                   a later job with the same id gets a fresh directory (a requeued
 *                   run of the job, back within an hour, keeps it and the mark goes),
 *                   and the retention sweep removes <jobid>/ retain= days after it
 *   .lock           root-only (0600) lock: checking, creating and removing job
 *                   directories happen under it, for steps and nodes sharing rundir=
 *   .new.<random>   a job directory being prepared; renamed to <jobid> when complete
 *   .trash.<random> a run directory being removed
 *
 * A user owns their run directory and may plant symlinks, hard links, fifos or deep
 * trees in it: everything here works relative to directory descriptors opened with
 * O_NOFOLLOW, creates with O_EXCL, and removes with unlinkat(2), which removes a link
 * and never what it points at.
 *
 * Pure POSIX: no Slurm calls and no logging (errors come back in err, one line), so
 * that it can be tested alone (tests/c/test_plugin_rundir.c).
 */
#define _GNU_SOURCE /* renameat2, RENAME_NOREPLACE */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "greyhound.h"

#define GH_LOCK_NAME ".lock"
#define GH_NEW_PREFIX ".new."
#define GH_TRASH_PREFIX ".trash."
#define GH_END_SUFFIX ".end"
#define GH_LOCK_WAIT_MS 10000    /* holders keep it for milliseconds */
#define GH_POSTMORTEM_GRACE_S 3600 /* retain=0 still leaves the post-mortem this long */
#define GH_ORPHAN_AGE_S 3600     /* a .new./.trash. entry this old was abandoned */
#define GH_REQUEUE_KEEP_S 3600   /* a job id back this soon after its end: a requeue */
#define GH_SWEEP_MAX 256         /* run directories removed per sweep at most */
#define GH_RM_MAX_DEPTH 32       /* deeper directories are moved up, not recursed into */
#define GH_RM_MAX_PASSES 100000

#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

#define FAIL(...)                                    \
	do {                                         \
		snprintf(err, err_len, __VA_ARGS__); \
		goto fail;                           \
	} while (0)

static const char rundir_rule[] =
	"allowed: a real directory owned by root, not writable by group or others, below "
	"root-owned directories (writable by others only with the sticky bit, like /var/tmp), "
	"no symlink on the path";

/* --- opening rundir= -------------------------------------------------------------- */

/* Why the directory fd (reached as path) is not safe, or NULL. */
static const char *unsafe_dir(int fd, int final, struct stat *st)
{
	if (fstat(fd, st) < 0)
		return "cannot be examined";
	if (st->st_uid != 0)
		return "is not owned by root";
	if (st->st_mode & (S_IWGRP | S_IWOTH)) {
		if (final)
			return "is writable by group or others";
		if (!(st->st_mode & S_ISVTX))
			return "is writable by group or others without the sticky bit";
	}
	return NULL;
}

/*
 * Opens rundir component by component from /, each with O_NOFOLLOW|O_DIRECTORY, and
 * checks every one (see the file's comment). With create, missing components are
 * made (root, 0755). Returns the directory's fd, or -1 with err set (errno ENOENT
 * when it is missing and create is 0, so a caller may stay quiet about that).
 */
int gh_rundir_open(const char *rundir, int create, char *err, size_t err_len)
{
	char path[PATH_MAX] = "";
	const char *p = rundir, *why;
	size_t path_len = 0;
	struct stat st;
	int fd = -1, next = -1, saved_errno = 0;

	if (rundir[0] != '/')
		FAIL("rundir=%s: not an absolute path", rundir);
	if ((fd = open("/", DIR_FLAGS)) < 0)
		FAIL("rundir=%s: /: %s", rundir, strerror(errno));
	if ((why = unsafe_dir(fd, rundir[strspn(rundir, "/")] == '\0', &st)) != NULL)
		FAIL("rundir=%s: / %s (mode %04o, uid %u); %s", rundir, why, (unsigned)(st.st_mode & 07777),
		     (unsigned)st.st_uid, rundir_rule);
	while (*p) {
		size_t len;
		int made = 0;

		p += strspn(p, "/");
		len = strcspn(p, "/");
		if (len == 0)
			break;
		if ((len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.'))
			FAIL("rundir=%s: '.' and '..' are not allowed in it", rundir);
		if (path_len + 1 + len >= sizeof(path))
			FAIL("rundir=%s: path too long", rundir);
		path[path_len++] = '/';
		memcpy(path + path_len, p, len);
		path_len += len;
		path[path_len] = '\0';
		p += len;

		next = openat(fd, path + path_len - len, DIR_FLAGS);
		if (next < 0 && errno == ENOENT && create) {
			if (mkdirat(fd, path + path_len - len, 0755) == 0)
				made = 1;
			else if (errno != EEXIST)
				FAIL("rundir=%s: cannot create %s: %s", rundir, path, strerror(errno));
			next = openat(fd, path + path_len - len, DIR_FLAGS);
		}
		if (next < 0) {
			struct stat lst;

			saved_errno = errno;
			if ((errno == ELOOP || errno == ENOTDIR) &&
			    fstatat(fd, path + path_len - len, &lst, AT_SYMLINK_NOFOLLOW) == 0)
				FAIL("rundir=%s: %s is %s; %s", rundir, path,
				     S_ISLNK(lst.st_mode) ? "a symlink" : "not a directory", rundir_rule);
			FAIL("rundir=%s: %s: %s", rundir, path, strerror(saved_errno));
		}
		close(fd);
		fd = next;
		next = -1;
		/* Made by us: the mode without slurmstepd's umask. */
		if (made && fchmod(fd, 0755) < 0)
			FAIL("rundir=%s: chmod %s: %s", rundir, path, strerror(errno));
		if ((why = unsafe_dir(fd, *(p + strspn(p, "/")) == '\0', &st)) != NULL)
			FAIL("rundir=%s: %s %s (mode %04o, uid %u); %s", rundir, path, why,
			     (unsigned)(st.st_mode & 07777), (unsigned)st.st_uid, rundir_rule);
	}
	return fd;
fail:
	if (next >= 0)
		close(next);
	if (fd >= 0)
		close(fd);
	errno = saved_errno ? saved_errno : EPERM;
	return -1;
}

/* --- the lock -------------------------------------------------------------------- */

/* Returns the lock's fd (close it, or gh_rundir_unlock, to release), or -1 with err. */
int gh_rundir_lock(int rundir_fd, char *err, size_t err_len)
{
	struct timespec pause = { 0, 10 * 1000 * 1000 };
	int fd, waited_ms = 0;

	fd = openat(rundir_fd, GH_LOCK_NAME, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0)
		FAIL("cannot open the lock %s: %s", GH_LOCK_NAME, strerror(errno));
	while (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		if (errno != EWOULDBLOCK && errno != EINTR)
			FAIL("cannot lock %s: %s", GH_LOCK_NAME, strerror(errno));
		if (waited_ms >= GH_LOCK_WAIT_MS)
			FAIL("%s held by another greyhound process for more than %d s", GH_LOCK_NAME,
			     GH_LOCK_WAIT_MS / 1000);
		nanosleep(&pause, NULL);
		waited_ms += 10;
	}
	return fd;
fail:
	if (fd >= 0)
		close(fd);
	return -1;
}

void gh_rundir_unlock(int lock_fd)
{
	if (lock_fd >= 0)
		close(lock_fd);
}

/* --- safe recursive removal ---------------------------------------------------- */

/* prefix + 16 random hex digits into name. */
static int random_name(char *name, size_t name_len, const char *prefix)
{
	unsigned char bytes[8];
	int n;

	if (getrandom(bytes, sizeof(bytes), 0) != (ssize_t)sizeof(bytes))
		return -1;
	n = snprintf(name, name_len, "%s%02x%02x%02x%02x%02x%02x%02x%02x", prefix, bytes[0], bytes[1], bytes[2],
		     bytes[3], bytes[4], bytes[5], bytes[6], bytes[7]);
	return (n < 0 || (size_t)n >= name_len) ? -1 : 0;
}

/*
 * Removes what is in dir_fd, never following a symlink and never leaving the file
 * system of top_fd. Below GH_RM_MAX_DEPTH a directory is moved up into top_fd (a user
 * can make trees deeper than any fd budget) and *moved is set, for another pass.
 * Returns 0, or -1 when something could not be removed.
 */
static int remove_contents(int top_fd, dev_t dev, int dir_fd, int depth, int *moved)
{
	struct dirent *e;
	DIR *d;
	int dup_fd, rv = 0;

	if ((dup_fd = fcntl(dir_fd, F_DUPFD_CLOEXEC, 0)) < 0)
		return -1;
	if ((d = fdopendir(dup_fd)) == NULL) {
		close(dup_fd);
		return -1;
	}
	rewinddir(d); /* a dup shares the offset, which an earlier pass left at the end */
	while ((errno = 0, e = readdir(d)) != NULL) {
		const char *name = e->d_name;
		struct stat st;
		int sub;

		if (!strcmp(name, ".") || !strcmp(name, ".."))
			continue;
		if (unlinkat(dir_fd, name, 0) == 0 || errno == ENOENT)
			continue;
		if (errno != EISDIR && errno != EPERM) {
			rv = -1;
			continue;
		}
		if (depth >= GH_RM_MAX_DEPTH) {
			char up[32];

			if (random_name(up, sizeof(up), ".deep.") < 0 || renameat(dir_fd, name, top_fd, up) < 0)
				rv = -1;
			else
				*moved = 1;
			continue;
		}
		sub = openat(dir_fd, name, DIR_FLAGS);
		if (sub < 0) {
			if (errno != ENOENT)
				rv = -1;
			continue;
		}
		if (fstat(sub, &st) < 0 || st.st_dev != dev) {
			close(sub); /* a mount point: never descend into another file system */
			rv = -1;
			continue;
		}
		if (remove_contents(top_fd, dev, sub, depth + 1, moved) < 0)
			rv = -1;
		close(sub);
		/* Fails while a deeper part was moved up: the next pass takes it. */
		if (unlinkat(dir_fd, name, AT_REMOVEDIR) < 0 && errno != ENOENT)
			rv = -1;
	}
	if (errno != 0)
		rv = -1;
	closedir(d);
	return rv;
}

/*
 * Removes parent_fd/name and everything below it, as `rm -rf` would but without
 * following any symlink (name itself included: a symlink is removed, not followed).
 * Returns 0 (also when it did not exist), or -1 with errno set.
 */
int gh_remove_tree_at(int parent_fd, const char *name)
{
	struct stat st;
	int fd, rv = -1, passes = 0, moved;

	if (unlinkat(parent_fd, name, 0) == 0 || errno == ENOENT)
		return 0;
	if (errno != EISDIR && errno != EPERM)
		return -1;
	if ((fd = openat(parent_fd, name, DIR_FLAGS)) < 0)
		return errno == ENOENT ? 0 : -1;
	if (fstat(fd, &st) < 0)
		goto out;
	do {
		moved = 0;
		rv = remove_contents(fd, st.st_dev, fd, 1, &moved);
	} while (moved && ++passes < GH_RM_MAX_PASSES);
	if (rv == 0 && (unlinkat(parent_fd, name, AT_REMOVEDIR) == 0 || errno == ENOENT))
		rv = 0;
	else
		rv = -1;
out:
	close(fd);
	if (rv < 0 && errno == 0)
		errno = EIO;
	return rv;
}

/* Moves parent_fd/name out of the way under a fresh trash name (in trash). */
static int move_to_trash(int rundir_fd, const char *name, char *trash, size_t trash_len)
{
	if (random_name(trash, trash_len, GH_TRASH_PREFIX) < 0)
		return -1;
	if (renameat(rundir_fd, name, rundir_fd, trash) == 0)
		return 0;
	trash[0] = '\0';
	return errno == ENOENT ? 0 : -1;
}

static int rename_noreplace(int dir_fd, const char *from, const char *to)
{
	if (renameat2(dir_fd, from, dir_fd, to, RENAME_NOREPLACE) == 0)
		return 0;
	if (errno != EINVAL && errno != ENOSYS)
		return -1;
	/* A file system without RENAME_NOREPLACE: we hold the lock and checked. */
	return renameat(dir_fd, from, dir_fd, to);
}

/* --- a job's run directory -------------------------------------------------------- */

static int job_names(uint32_t job_id, char *name, size_t name_len, char *end, size_t end_len)
{
	int n = snprintf(name, name_len, "%u", job_id);
	int m = snprintf(end, end_len, "%u" GH_END_SUFFIX, job_id);

	return (n < 0 || (size_t)n >= name_len || m < 0 || (size_t)m >= end_len) ? -1 : 0;
}

/*
 * The job's run directory rundir/<job_id>, owned by uid:gid, mode 0700, fresh for a
 * new job: an existing one is reused only when it belongs to this job (owned by uid,
 * and no <job_id>.end mark: the mark says an earlier job with this id ended); else it
 * is removed (another user's, or a reused job id's) and a new one made. The new one
 * appears complete (made under a temporary name, then renamed). Returns its fd, or
 * -1 with err set.
 *
 * A requeued job (greyhound's S4, an admin's scontrol requeue) ends and starts again
 * with the same id: its next run goes on in the directory of the run before, so that
 * its event log still says why it was requeued and its timeline continues. Slurm 22.05
 * tells a SPANK plugin nothing of the requeue here (S_SLURM_RESTART_COUNT reads 0, and
 * SLURM_RESTART_COUNT is not yet in the job's environment), so a directory of the same
 * user whose mark is younger than GH_REQUEUE_KEEP_S counts as that job's: a job id
 * comes back that soon only for a requeue (ids are reused after a controller starts
 * afresh, or wrap at 67 million), and never hands one user's files to another.
 */
int gh_job_dir_prepare(int rundir_fd, uint32_t job_id, uid_t uid, gid_t gid, time_t now, char *err,
		       size_t err_len)
{
	char name[16], end[24], tmp[32] = "", trash[32] = "";
	struct stat st, end_st;
	int lock_fd = -1, fd = -1, rv = -1;

	if (err_len > 0)
		err[0] = '\0';
	if (job_names(job_id, name, sizeof(name), end, sizeof(end)) < 0)
		FAIL("job id %u: name too long", job_id);
	if ((lock_fd = gh_rundir_lock(rundir_fd, err, err_len)) < 0)
		goto fail;
	fd = openat(rundir_fd, name, DIR_FLAGS);
	if (fd >= 0) {
		int ended = fstatat(rundir_fd, end, &end_st, AT_SYMLINK_NOFOLLOW) == 0;

		if (fstat(fd, &st) < 0)
			FAIL("stat %s: %s", name, strerror(errno));
		int requeued = ended && end_st.st_mtime > now - GH_REQUEUE_KEEP_S;

		if (st.st_uid == uid && (!ended || requeued)) {
			/* This job's, from another step or node, or its run before a requeue:
			 * keep it, as we make it; running again, it has not ended. */
			if ((st.st_gid != gid && fchown(fd, uid, gid) < 0) ||
			    ((st.st_mode & 07777) != 0700 && fchmod(fd, 0700) < 0))
				FAIL("%s: cannot restore owner %u:%u and mode 0700: %s", name, (unsigned)uid,
				     (unsigned)gid, strerror(errno));
			if (ended && unlinkat(rundir_fd, end, 0) < 0 && errno != ENOENT)
				FAIL("cannot remove %s: %s", end, strerror(errno));
			rv = 0;
			goto fail; /* done: unlock and return fd */
		}
		close(fd);
		fd = -1;
	} else if (errno != ENOENT && errno != ELOOP && errno != ENOTDIR) {
		FAIL("open %s: %s", name, strerror(errno));
	}
	/* Stale (or not a directory, or missing): out of the way, and its mark too. */
	if (move_to_trash(rundir_fd, name, trash, sizeof(trash)) < 0)
		FAIL("cannot move the stale %s aside: %s", name, strerror(errno));
	if (unlinkat(rundir_fd, end, 0) < 0 && errno != ENOENT)
		FAIL("cannot remove %s: %s", end, strerror(errno));

	if (random_name(tmp, sizeof(tmp), GH_NEW_PREFIX) < 0)
		FAIL("no random name: %s", strerror(errno));
	if (mkdirat(rundir_fd, tmp, 0700) < 0) {
		snprintf(err, err_len, "mkdir %s: %s", tmp, strerror(errno));
		tmp[0] = '\0';
		goto fail;
	}
	if ((fd = openat(rundir_fd, tmp, DIR_FLAGS)) < 0)
		FAIL("open %s: %s", tmp, strerror(errno));
	if (fchown(fd, uid, gid) < 0 || fchmod(fd, 0700) < 0)
		FAIL("cannot give the run directory to %u:%u: %s", (unsigned)uid, (unsigned)gid, strerror(errno));
	if (rename_noreplace(rundir_fd, tmp, name) < 0)
		FAIL("rename %s to %s: %s", tmp, name, strerror(errno));
	tmp[0] = '\0';
	rv = 0;
fail:
	if (rv < 0 && fd >= 0) {
		close(fd);
		fd = -1;
	}
	if (tmp[0])
		gh_remove_tree_at(rundir_fd, tmp);
	gh_rundir_unlock(lock_fd);
	/* The old directory goes after the lock is released: it may be large. */
	if (trash[0] && gh_remove_tree_at(rundir_fd, trash) < 0 && rv == 0)
		snprintf(err, err_len, "the stale run directory, moved to %s, was not removed completely", trash);
	return rv < 0 ? -1 : fd;
}

/*
 * At the end of a job on a node: removes the rings (ring.*) from rundir/<job_id> and
 * marks the job as ended (<job_id>.end, kept from the first node that ended it).
 * Everything else (timeline, options, report) stays for the post-mortem and the
 * user. Returns 1 when the job had a run directory, 0 when not, -1 with err.
 */
int gh_job_dir_end(int rundir_fd, uint32_t job_id, char *err, size_t err_len)
{
	char name[16], end[24];
	struct dirent *e;
	DIR *d = NULL;
	int fd = -1, dup_fd = -1, mark, rv = -1, failed = 0;

	if (job_names(job_id, name, sizeof(name), end, sizeof(end)) < 0)
		FAIL("job id %u: name too long", job_id);
	if ((fd = openat(rundir_fd, name, DIR_FLAGS)) < 0) {
		if (errno == ENOENT)
			return 0;
		FAIL("open %s: %s", name, strerror(errno));
	}
	if ((dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0 || (d = fdopendir(dup_fd)) == NULL)
		FAIL("read %s: %s", name, strerror(errno));
	dup_fd = -1;
	rewinddir(d);
	/* Removing the entry just read is safe while reading on (Linux). */
	while ((e = readdir(d)) != NULL) {
		if (!strncmp(e->d_name, "ring.", 5) && gh_remove_tree_at(fd, e->d_name) < 0)
			failed = 1;
	}
	mark = openat(rundir_fd, end, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (mark < 0 && errno != EEXIST)
		FAIL("cannot create %s: %s", end, strerror(errno));
	if (mark >= 0)
		close(mark);
	if (failed)
		FAIL("%s: some rings could not be removed", name);
	rv = 1;
fail:
	if (d)
		closedir(d);
	if (dup_fd >= 0)
		close(dup_fd);
	if (fd >= 0)
		close(fd);
	return rv;
}

/*
 * Writes content to dir_fd/name, owned by uid:gid, mode 0600, atomically: a new file
 * under an unpredictable name (O_CREAT|O_EXCL|O_NOFOLLOW: nothing the directory's
 * owner planted is opened), renamed over name (which replaces a planted symlink, never
 * follows it). Returns 0, or -1 with err set.
 */
int gh_job_file_write(int dir_fd, const char *name, const char *content, uid_t uid, gid_t gid, char *err,
		      size_t err_len)
{
	char tmp[32] = "";
	size_t len = strlen(content), done = 0;
	int fd = -1, rv = -1;

	if (random_name(tmp, sizeof(tmp), ".tmp.") < 0) {
		tmp[0] = '\0';
		FAIL("%s: no random name: %s", name, strerror(errno));
	}
	if ((fd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600)) < 0) {
		snprintf(err, err_len, "%s: create %s: %s", name, tmp, strerror(errno));
		tmp[0] = '\0';
		goto fail;
	}
	while (done < len) {
		ssize_t n = write(fd, content + done, len - done);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			FAIL("%s: write: %s", name, n < 0 ? strerror(errno) : "no progress");
		done += (size_t)n;
	}
	if (fchown(fd, uid, gid) < 0 || fchmod(fd, 0600) < 0)
		FAIL("%s: cannot give it to %u:%u: %s", name, (unsigned)uid, (unsigned)gid, strerror(errno));
	if (close(fd) < 0) {
		fd = -1;
		FAIL("%s: close: %s", name, strerror(errno));
	}
	fd = -1;
	if (renameat(dir_fd, tmp, dir_fd, name) < 0)
		FAIL("%s: rename: %s", name, strerror(errno));
	tmp[0] = '\0';
	rv = 0;
fail:
	if (fd >= 0)
		close(fd);
	if (tmp[0])
		unlinkat(dir_fd, tmp, 0);
	return rv;
}

/* Is name "<digits>.end"? Puts the digits' value in *job_id. */
static int parse_end_name(const char *name, uint32_t *job_id)
{
	unsigned long long v = 0;
	const char *p = name;

	if (*p < '0' || *p > '9')
		return 0;
	for (; *p >= '0' && *p <= '9'; p++) {
		v = v * 10 + (unsigned)(*p - '0');
		if (v > UINT32_MAX)
			return 0;
	}
	if (strcmp(p, GH_END_SUFFIX) != 0)
		return 0;
	*job_id = (uint32_t)v;
	return 1;
}

/*
 * Retention: removes the run directories of jobs that ended more than retain_days
 * ago (at least GH_POSTMORTEM_GRACE_S, so that retain=0 still leaves the post-mortem
 * its input), with their marks, and abandoned .new./.trash. entries. A directory
 * without a mark (its job still runs, or its node never ran the job epilog) is left
 * alone. Returns the number of run directories removed, or -1 with err set (what
 * could be removed, was).
 */
int gh_rundir_sweep(int rundir_fd, int retain_days, time_t now, char *err, size_t err_len)
{
	uint32_t expired[GH_SWEEP_MAX];
	char orphans[16][32];
	time_t min_age = (time_t)retain_days * 86400;
	size_t num_expired = 0, num_orphans = 0;
	struct dirent *e;
	DIR *d = NULL;
	int dup_fd, removed = 0, failed = 0;

	if (min_age < GH_POSTMORTEM_GRACE_S)
		min_age = GH_POSTMORTEM_GRACE_S;
	if ((dup_fd = fcntl(rundir_fd, F_DUPFD_CLOEXEC, 0)) < 0 || (d = fdopendir(dup_fd)) == NULL) {
		if (dup_fd >= 0)
			close(dup_fd);
		FAIL("cannot read the run directories: %s", strerror(errno));
	}
	rewinddir(d); /* the dup shares rundir_fd's offset */
	while ((e = readdir(d)) != NULL) {
		struct stat st;
		uint32_t job_id;

		if (parse_end_name(e->d_name, &job_id)) {
			if (num_expired < GH_SWEEP_MAX && fstatat(rundir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
			    now - st.st_mtime >= min_age)
				expired[num_expired++] = job_id;
		} else if ((!strncmp(e->d_name, GH_NEW_PREFIX, strlen(GH_NEW_PREFIX)) ||
			    !strncmp(e->d_name, GH_TRASH_PREFIX, strlen(GH_TRASH_PREFIX))) &&
			   strlen(e->d_name) < sizeof(orphans[0]) && num_orphans < 16 &&
			   fstatat(rundir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
			   now - st.st_mtime >= GH_ORPHAN_AGE_S) {
			strcpy(orphans[num_orphans++], e->d_name);
		}
	}
	closedir(d);
	d = NULL;

	for (size_t i = 0; i < num_expired; i++) {
		char name[16], end[24], trash[32] = "";
		struct stat st;
		int lock_fd;

		if (job_names(expired[i], name, sizeof(name), end, sizeof(end)) < 0)
			continue;
		if ((lock_fd = gh_rundir_lock(rundir_fd, err, err_len)) < 0)
			goto fail;
		/* Checked again under the lock: a new job with this id may have started. */
		if (fstatat(rundir_fd, end, &st, AT_SYMLINK_NOFOLLOW) == 0 && now - st.st_mtime >= min_age) {
			if (move_to_trash(rundir_fd, name, trash, sizeof(trash)) < 0 ||
			    (unlinkat(rundir_fd, end, 0) < 0 && errno != ENOENT))
				failed = 1;
		}
		gh_rundir_unlock(lock_fd);
		if (trash[0]) {
			if (gh_remove_tree_at(rundir_fd, trash) < 0)
				failed = 1;
			else
				removed++;
		}
	}
	for (size_t i = 0; i < num_orphans; i++) {
		if (gh_remove_tree_at(rundir_fd, orphans[i]) < 0)
			failed = 1;
	}
	if (failed)
		FAIL("some expired run directories were not removed completely");
	return removed;
fail:
	if (d)
		closedir(d);
	return -1;
}
