/*
 * Job-script context: slurmd runs `slurmstepd spank epilog` as root on every node of
 * a job when it ends (SPANK's job_epilog), for every job, greyhound's or not.
 *
 * Checked on Slurm 22.05 (Debian 12): it runs without any Epilog= in slurm.conf, but
 * slurmd decides at its start whether a plugin of the plugstack has a job epilog:
 * after installing this plugin (or an older one without it), restart slurmd
 * (`scontrol reconfigure` is not enough). slurm_spank_init is not called in this
 * context, so the plugstack arguments are parsed here.
 *
 * It removes the job's rings and marks its run directory as ended (rundir.c), then
 * applies retain=: run directories of jobs that ended more than retain= days ago go.
 */
#include <errno.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "greyhound.h"

int gh_job_epilog(spank_t sp, int ac, char **av)
{
	struct gh_config config;
	char err[GH_ERR_LEN] = "";
	uint32_t job_id;
	int rundir_fd, removed;

	gh_config_defaults(&config);
	if (gh_config_parse(&config, ac, av, err, sizeof(err)) < 0) {
		/* Said at every step of every job already (slurm_spank_init). */
		slurm_debug("greyhound: job epilog: plugstack.conf: %s; nothing cleaned up", err);
		return 0;
	}
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
		slurm_error("greyhound: job epilog: cannot get the job's id; nothing cleaned up");
		return 0;
	}
	if ((rundir_fd = gh_rundir_open(config.rundir, 0, err, sizeof(err))) < 0) {
		/*
		 * Missing: no greyhound job ran here. Unsafe: every greyhound job's steps
		 * say so as an error (and run without greyhound); this runs for every job.
		 */
		if (errno != ENOENT)
			slurm_debug("greyhound: job epilog: job %u: unsafe or unusable %s; nothing cleaned up", job_id,
				    err);
		return 0;
	}
	if (gh_job_dir_end(rundir_fd, job_id, err, sizeof(err)) < 0)
		slurm_error("greyhound: job epilog: job %u: %s/%s", job_id, config.rundir, err);
	err[0] = '\0';
	removed = gh_rundir_sweep(rundir_fd, config.retain_days, time(NULL), err, sizeof(err));
	if (removed < 0)
		slurm_error("greyhound: job epilog: retain=%d: %s/: %s", config.retain_days, config.rundir, err);
	else if (removed > 0)
		slurm_info("greyhound: job epilog: removed %d run directories of jobs that ended more than %d days ago",
			   removed, config.retain_days);
	close(rundir_fd);
	return 0;
}
