/*
 * The user's --greyhound[=OPTIONS] flag for sbatch, salloc and srun.
 */
#include <stdio.h>
#include <string.h>

#include "greyhound.h"

/* How Slurm forwards a plugin option to the job's environment (spank(8)). */
#define GH_OPTION_ENV "SLURM_SPANK__SLURM_SPANK_OPTION_greyhound_greyhound"

static int option_cb(int val, const char *optarg, int remote)
{
	char err[512] = "";

	(void)val;
	/* Slurm may call this twice with the same value; parsing is idempotent for that. */
	if (gh_options_parse(&gh_options, optarg, err, sizeof(err)) == 0)
		return 0;
	if (remote) {
		/* Fail open on the node: never refuse a running job over greyhound. */
		slurm_error("greyhound: %s; greyhound is off for this job", err + strlen("--greyhound: "));
		gh_options_defaults(&gh_options);
		gh_options.seen = 1;
		gh_options.enabled = 0;
		return 0;
	}
	fprintf(stderr, "greyhound: %s\n", err);
	return -1;
}

static struct spank_option greyhound_option = {
	.name = "greyhound",
	.arginfo = "options",
	.usage = "[greyhound] find and mitigate stragglers; OPTIONS: off | detect | mitigate | "
		 "key=value,... with mode=detect|mitigate, trace=on|off, report=DIR",
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
	spank_err_t rc;

	if (gh_options.seen)
		return 0;
	rc = spank_getenv(sp, GH_OPTION_ENV, value, sizeof(value));
	if (rc == ESPANK_ENV_NOEXIST)
		return 0;
	if (rc != ESPANK_SUCCESS) {
		slurm_error("greyhound: cannot read %s: %s", GH_OPTION_ENV, spank_strerror(rc));
		return -1;
	}
	return option_cb(0, value, 1);
}
