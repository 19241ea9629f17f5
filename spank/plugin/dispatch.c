/*
 * The only file that defines slurm_spank_* hooks; each forwards to the file of its
 * context (args.c: local/allocator, remote.c: slurmstepd, jobscript.c: job epilog).
 */
#include <string.h>

#include "greyhound.h"

/* Built with -fvisibility=hidden: what Slurm looks up is made visible here only. */
#pragma GCC visibility push(default)
SPANK_PLUGIN(greyhound, 1);

struct gh_config gh_config;
struct gh_options gh_options;

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	char err[GH_ERR_LEN] = "";

	gh_config_defaults(&gh_config);
	gh_options_defaults(&gh_options);
	if (gh_config_parse(&gh_config, ac, av, err, sizeof(err)) < 0) {
		/*
		 * A broken admin configuration turns greyhound off, never the job: the
		 * option is still registered so that scripts saying --greyhound submit.
		 */
		slurm_error("greyhound: plugstack.conf: %s; greyhound is off", err);
		gh_config_defaults(&gh_config);
		gh_config.broken = 1;
	}
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
	case S_CTX_REMOTE:
		/*
		 * sbatch options must be registered here, not through spank_options.
		 * A failure is logged and leaves the job alone (fail open).
		 */
		gh_register_options(sp);
		return 0;
	default:
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return gh_local_init_post_opt();
	case S_CTX_REMOTE:
		/* Still root here (user_init runs as the job's user): the run dir is made now. */
		return gh_remote_init_post_opt(sp);
	default:
		return 0;
	}
}

/*
 * Remote context only: in each task, as the job's user, just before exec (the batch
 * step's task starts the job's control plane here).
 */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return gh_remote_task_init(sp);
}

/* Job-script context only: as root on each node of every job when it ends. */
int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
	return gh_job_epilog(sp, ac, av);
}
#pragma GCC visibility pop
