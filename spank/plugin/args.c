/*
 * The user's --greyhound[=OPTIONS] flag for sbatch, salloc and srun.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "greyhound.h"

/* How Slurm forwards a plugin option to the job's environment (spank(8)). */
#define GH_OPTION_ENV "SLURM_SPANK__SLURM_SPANK_OPTION_greyhound_greyhound"
/*
 * The user's environment fallback, same syntax as the flag. Precedence (STYLE):
 * plugstack defaults < GREYHOUND_OPTIONS < --greyhound=, as pyxis reads PYXIS_*
 * only when the flag was not given.
 */
#define GH_USER_ENV "GREYHOUND_OPTIONS"
#define GH_FLAG "--greyhound"

/*
 * Fail open on the node: a bad setting turns greyhound off, never the job. source
 * says where the value came from (the flag, GREYHOUND_OPTIONS); the parser gives the
 * bare cause.
 */
static void off_for_this_job(const char *source, const char *why)
{
	slurm_error("greyhound: %s: %s; greyhound is off for this job", source, why);
	gh_options_defaults(&gh_options);
	gh_options.seen = 1;
	gh_options.enabled = 0;
}

static int option_cb(int val, const char *optarg, int remote)
{
	char err[GH_ERR_LEN] = "";

	(void)val;
	/* Slurm may call this twice: the same value again is accepted, a different one refused. */
	if (gh_options_parse(&gh_options, optarg, err, sizeof(err)) == 0)
		return 0;
	if (remote) {
		off_for_this_job(GH_FLAG, err);
		return 0;
	}
	fprintf(stderr, "greyhound: " GH_FLAG ": %s\n", err);
	return -1;
}

static struct spank_option greyhound_option = {
	.name = "greyhound",
	.arginfo = "options",
	.usage = "[greyhound] find and mitigate stragglers; OPTIONS: off | detect | mitigate | "
		 "key=value,... with mode=detect|mitigate, trace=on|off, report=DIR, requeue=on|off "
		 "(default: $GREYHOUND_OPTIONS)",
	.has_arg = 2, /* optional argument */
	.val = 0,
	.cb = option_cb,
};

int gh_register_options(spank_t sp)
{
	spank_err_t rc = spank_option_register(sp, &greyhound_option);

	if (rc != ESPANK_SUCCESS) {
		slurm_error("greyhound: cannot register --greyhound: %s", spank_strerror(rc));
		return -1;
	}
	return 0;
}

/*
 * The batch step of `sbatch --export=NONE` does not get the option callback; the
 * forwarded option is still in the job's environment, so read it from there.
 */
int gh_options_from_env(spank_t sp)
{
	char value[GH_OPTION_MAX_LEN + 2] = "";
	char err[GH_ERR_LEN] = "";
	spank_err_t rc;

	if (gh_options.seen)
		return 0;
	rc = spank_getenv(sp, GH_OPTION_ENV, value, sizeof(value));
	if (rc == ESPANK_SUCCESS)
		return option_cb(0, value, 1);
	if (rc != ESPANK_ENV_NOEXIST) {
		slurm_error("greyhound: cannot read %s: %s", GH_OPTION_ENV, spank_strerror(rc));
		return -1;
	}
	/* No flag: the user's GREYHOUND_OPTIONS, if the job's environment has it. */
	rc = spank_getenv(sp, GH_USER_ENV, value, sizeof(value));
	if (rc == ESPANK_ENV_NOEXIST)
		return 0;
	if (rc == ESPANK_SUCCESS && gh_options_parse(&gh_options, value, err, sizeof(err)) == 0)
		return 0;
	off_for_this_job(GH_USER_ENV, rc == ESPANK_SUCCESS ? err : spank_strerror(rc));
	return 0;
}

/*
 * sbatch, salloc and srun: a bad GREYHOUND_OPTIONS gets its one line here, where the
 * user sees it. Unlike a bad flag it cannot refuse the job (the plugin is optional,
 * so Slurm ignores a failed init_post_opt): the job runs without greyhound, as the
 * remote side decides from the same variable. The flag, when given, wins and the
 * variable is not looked at.
 */
int gh_local_init_post_opt(void)
{
	const char *value = getenv(GH_USER_ENV);
	struct gh_options options;
	char err[GH_ERR_LEN] = "";

	if (gh_options.seen || value == NULL)
		return 0;
	gh_options_defaults(&options);
	if (gh_options_parse(&options, value, err, sizeof(err)) == 0)
		return 0;
	fprintf(stderr, "greyhound: " GH_USER_ENV ": %s; greyhound is off for this job\n", err);
	return 0;
}
