/*
 * Remote context (slurmstepd): prepare every task of an enabled job.
 *
 * In slurm_spank_init_post_opt, as root before the tasks fork, for every step
 * (batch, srun):
 *   - check rundir= and make the job's run directory in it (rundir.c: by file
 *     descriptor; mode 0700, owned by the job's user, fresh for a reused job id);
 *   - export GREYHOUND_* into the job's environment;
 *   - prepend the hook to LD_PRELOAD and the Python capture to PYTHONPATH, keeping
 *     the user's own value exactly after it (pathlist.c); not in the control plane's
 *     own step (GREYHOUND_CONTROL_PLANE=1 in its environment), whose MPI calls must
 *     not be recorded.
 * In slurm_spank_task_init of the batch step (its one task, as the job's user, just
 * before the batch script is exec'd), once per job: start the job's control plane,
 * `<python=> -I -m greyhound.control.launch`, as a child of the batch script
 * (controlplane.c). task_init, not user_init: user_init runs in slurmstepd itself,
 * multithreaded (its child would carry slurmstepd's fds and signal mask, and be a
 * sibling of the script outside the task's cgroup); task_init runs in the task, a
 * fork of slurmstepd already running as the user, in the job's cgroup, with the
 * task's environment and the job's stdout/stderr, so that its child is the script's
 * child (proctrack/linuxproc ends the descendants of the step's slurmstepd).
 * Any failure is logged once and leaves the job as if greyhound were not there.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <slurm/slurm.h> /* SLURM_BATCH_SCRIPT */

#include "greyhound.h"

#define GH_ENV_MAX (64 * 1024) /* longest LD_PRELOAD/PYTHONPATH handled */

/*
 * What init_post_opt (in slurmstepd) leaves for task_init (in the task it forks):
 * whether this is the batch step of a job that gets a control plane, and the entries
 * it put in front of LD_PRELOAD and PYTHONPATH ("" when none).
 */
static struct {
	int start_plane;
	uint32_t job_id;
	char hook[PATH_MAX];
	char capture[PATH_MAX];
} remote;

static int set_env(spank_t sp, const char *name, const char *value)
{
	spank_err_t rc = spank_setenv(sp, name, value, 1);

	if (rc != ESPANK_SUCCESS) {
		slurm_error("greyhound: remote: cannot set %s: %s", name, spank_strerror(rc));
		return -1;
	}
	return 0;
}

/*
 * Records the job's effective options in the run directory for the post-mortem
 * (EpilogSlurmctld does not see the job's environment).
 */
static int write_options_file(int job_fd, const char *run_dir, uid_t uid, gid_t gid)
{
	char content[64 + PATH_MAX], err[GH_ERR_LEN] = "";
	int n;

	n = snprintf(content, sizeof(content), "mode=%s\ntrace=%s\nreport=%s\nrequeue=%s\n",
		     gh_effective_mode(&gh_config, &gh_options), gh_options.trace == 0 ? "off" : "on",
		     gh_options.report, gh_effective_requeue(&gh_config, &gh_options) ? "on" : "off");
	if (n < 0 || (size_t)n >= sizeof(content)) {
		slurm_error("greyhound: remote: %s/options: too long; not written", run_dir);
		return -1;
	}
	if (gh_job_file_write(job_fd, "options", content, uid, gid, err, sizeof(err)) < 0) {
		slurm_error("greyhound: remote: %s/%s", run_dir, err);
		return -1;
	}
	return 0;
}

/*
 * Puts entry first in the variable name of the job's environment; the user's value
 * follows exactly as it was (an unset variable becomes entry alone).
 */
static int prepend_env(spank_t sp, const char *name, const char *entry, const char *separators)
{
	char *current = NULL, *updated = NULL;
	spank_err_t rc;
	int rv = -1;

	if ((current = malloc(GH_ENV_MAX)) == NULL || (updated = malloc(GH_ENV_MAX)) == NULL) {
		slurm_error("greyhound: remote: %s: out of memory; left unchanged", name);
		goto fail;
	}
	rc = spank_getenv(sp, name, current, GH_ENV_MAX);
	if (rc != ESPANK_SUCCESS && rc != ESPANK_ENV_NOEXIST) {
		slurm_error("greyhound: remote: cannot read %s: %s; left unchanged", name, spank_strerror(rc));
		goto fail;
	}
	if (gh_path_prepend(updated, GH_ENV_MAX, entry, rc == ESPANK_SUCCESS ? current : NULL, separators) < 0) {
		slurm_error("greyhound: remote: %s would exceed %d characters; left unchanged", name, GH_ENV_MAX - 1);
		goto fail;
	}
	rv = set_env(sp, name, updated);
fail:
	free(current);
	free(updated);
	return rv;
}

/* The control plane's own step: srun started by launch.py marks its environment. */
static int is_control_plane_step(spank_t sp)
{
	char value[8];

	return spank_getenv(sp, GH_CONTROL_PLANE_ENV, value, sizeof(value)) == ESPANK_SUCCESS && !strcmp(value, "1");
}

int gh_remote_init_post_opt(spank_t sp)
{
	char job_id_str[16], run_dir[PATH_MAX], path[PATH_MAX], err[GH_ERR_LEN] = "";
	int n, rundir_fd = -1, job_fd = -1, plane_step;
	uint32_t job_id, step_id;
	uid_t uid;
	gid_t gid;

	if (gh_options_from_env(sp) < 0 || !gh_enabled(&gh_config, &gh_options))
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS) {
		slurm_error("greyhound: remote: cannot get the job's id, uid or gid; greyhound is off");
		return 0;
	}
	snprintf(job_id_str, sizeof(job_id_str), "%u", job_id);
	n = snprintf(run_dir, sizeof(run_dir), "%s/%u", gh_config.rundir, job_id);
	if (n < 0 || (size_t)n >= sizeof(run_dir)) {
		slurm_error("greyhound: remote: run directory path too long; greyhound is off for job %u", job_id);
		return 0;
	}
	if ((rundir_fd = gh_rundir_open(gh_config.rundir, 1, err, sizeof(err))) < 0) {
		slurm_error("greyhound: remote: unsafe or unusable %s; greyhound is off for job %u", err, job_id);
		return 0;
	}
	if ((job_fd = gh_job_dir_prepare(rundir_fd, job_id, uid, gid, time(NULL), err, sizeof(err))) < 0) {
		slurm_error("greyhound: remote: run directory %s: %s; greyhound is off for job %u", run_dir, err, job_id);
		goto out;
	}
	if (err[0])
		slurm_info("greyhound: remote: run directory %s: %s", run_dir, err);
	write_options_file(job_fd, run_dir, uid, gid);
	if (set_env(sp, "GREYHOUND_JOB_ID", job_id_str) < 0 ||
	    set_env(sp, "GREYHOUND_MODE", gh_effective_mode(&gh_config, &gh_options)) < 0 ||
	    set_env(sp, "GREYHOUND_REQUEUE", gh_effective_requeue(&gh_config, &gh_options) ? "on" : "off") < 0 ||
	    set_env(sp, "GREYHOUND_RUN_DIR", run_dir) < 0 ||
	    set_env(sp, "GREYHOUND_PREFIX", gh_config.prefix) < 0 ||
	    set_env(sp, "GREYHOUND_TRACE", gh_options.trace == 0 ? "off" : "on") < 0)
		goto out;
	if (gh_options.report[0] && set_env(sp, "GREYHOUND_REPORT_DIR", gh_options.report) < 0)
		goto out;

	/* Its GREYHOUND_* as any step's; the search paths as the user left them. */
	if ((plane_step = is_control_plane_step(sp)))
		goto plane;

	n = snprintf(path, sizeof(path), "%s/" GH_LIBDIR "/" GH_HOOK_LIB, gh_config.prefix);
	if (n < 0 || (size_t)n >= sizeof(path))
		slurm_error("greyhound: remote: hook path too long; calls are not recorded");
	else if (access(path, R_OK) < 0)
		slurm_info("greyhound: remote: %s: %s; calls are not recorded", path, strerror(errno));
	else if (prepend_env(sp, "LD_PRELOAD", path, ": ") == 0) /* ld.so(8): ':' or ' ' separate */
		strcpy(remote.hook, path);

	/* Python capture for backends the C hook cannot see (gloo): a sitecustomize. */
	n = snprintf(path, sizeof(path), "%s/" GH_LIBDIR "/python", gh_config.prefix);
	if (n >= 0 && (size_t)n < sizeof(path) && access(path, R_OK | X_OK) == 0 &&
	    prepend_env(sp, "PYTHONPATH", path, ":") == 0)
		strcpy(remote.capture, path);
plane:
	/* The batch step starts the job's control plane in its task (task_init). */
	if (plane_step || spank_get_item(sp, S_JOB_STEPID, &step_id) != ESPANK_SUCCESS ||
	    step_id != SLURM_BATCH_SCRIPT)
		goto out;
	if (!gh_config.python[0]) {
		slurm_info("greyhound: remote: no python= in plugstack.conf; no control plane for job %u (online "
			   "detection is off, calls are still recorded)", job_id);
		goto out;
	}
	remote.start_plane = 1;
	remote.job_id = job_id;
out:
	if (job_fd >= 0)
		close(job_fd);
	if (rundir_fd >= 0)
		close(rundir_fd);
	return 0;
}

/*
 * Each task, as the job's user, just before exec. In the batch step of an enabled job
 * (init_post_opt decided), the control plane starts here, once: the batch step has
 * one task. A failure is one line in the job's output, where its user looks, and the
 * script runs on.
 */
int gh_remote_task_init(spank_t sp)
{
	char err[GH_ERR_LEN] = "";
	char **env = NULL;
	pid_t pid;

	if (!remote.start_plane)
		return 0;
	remote.start_plane = 0;
	if (spank_get_item(sp, S_JOB_ENV, &env) != ESPANK_SUCCESS || env == NULL) {
		snprintf(err, sizeof(err), "cannot get the job's environment");
		goto fail;
	}
	if (gh_control_plane_start(gh_config.python, env, remote.hook, remote.capture, &pid, err, sizeof(err)) < 0)
		goto fail;
	slurm_verbose("greyhound: remote: job %u: control plane launcher started (pid %ld): %s -I -m "
		      "greyhound.control.launch", remote.job_id, (long)pid, gh_config.python);
	return 0;
fail:
	slurm_error("greyhound: remote: control plane not started for job %u: %s; the job runs without online "
		    "detection", remote.job_id, err);
	return 0;
}
