/*
 * Unit test of the SPANK plugin's option and plugstack parsers (spank/plugin/config.c),
 * built with ASan/UBSan by tests/test_plugin_config.py. The parsers log nothing and
 * need no Slurm: they return the bare cause. Prints "N passed, N failed".
 */
#include <stdio.h>
#include <string.h>

#include "greyhound.h"

static int passed, failed;

#define CHECK(cond)                                                         \
	do {                                                                \
		if (cond) {                                                 \
			passed++;                                           \
		} else {                                                    \
			failed++;                                           \
			fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
		}                                                           \
	} while (0)

static int parse(struct gh_options *o, const char *value, char *err)
{
	gh_options_defaults(o);
	err[0] = '\0';
	return gh_options_parse(o, value, err, 512);
}

/* A bare flag, in all the ways Slurm delivers it, means on with defaults. */
static void test_flag_forms(void)
{
	struct gh_options o;
	char err[512];

	CHECK(parse(&o, NULL, err) == 0 && o.enabled == 1);
	CHECK(parse(&o, "", err) == 0 && o.enabled == 1);
	CHECK(parse(&o, "(null)", err) == 0 && o.enabled == 1 && o.mode[0] == '\0');

	CHECK(parse(&o, "off", err) == 0 && o.enabled == 0);
	CHECK(parse(&o, "mitigate", err) == 0 && o.enabled == 1 && !strcmp(o.mode, "mitigate"));
	CHECK(parse(&o, "mode=detect,trace=off,report=/r/x", err) == 0 && !strcmp(o.mode, "detect") &&
	      o.trace == 0 && !strcmp(o.report, "/r/x"));
	CHECK(parse(&o, "detect,mode=detect", err) == 0); /* same value twice is fine */
}

/* Every setting: the same value twice is accepted, a different one refused. */
static void test_repeated_settings(void)
{
	struct gh_options o;
	char err[512];

	CHECK(parse(&o, "on,on", err) == 0 && o.enabled == 1);
	CHECK(parse(&o, "off,off", err) == 0 && o.enabled == 0);
	CHECK(parse(&o, "on,off", err) < 0 && !strcmp(err, "'on' and 'off' both given; give one of them"));
	CHECK(parse(&o, "off,on", err) < 0 && strstr(err, "'on' and 'off' both given"));
	CHECK(parse(&o, "report=/a,report=/a", err) == 0 && !strcmp(o.report, "/a"));
	CHECK(parse(&o, "report=/a,report=/b", err) < 0 &&
	      !strcmp(err, "report given twice, with different directories; give it once"));
	CHECK(parse(&o, "trace=on,trace=yes", err) == 0 && o.trace == 1);
	CHECK(parse(&o, "trace=on,trace=off", err) < 0 && !strcmp(err, "trace given twice ('on' and 'off'); give it once"));
	CHECK(parse(&o, "requeue=off", err) == 0 && o.requeue == 0 && o.enabled == 1);
	CHECK(parse(&o, "mitigate", err) == 0 && o.requeue == -1);
	CHECK(parse(&o, "requeue=off,requeue=no", err) == 0 && o.requeue == 0);
	CHECK(parse(&o, "requeue=off,requeue=on", err) < 0 &&
	      !strcmp(err, "requeue given twice ('off' and 'on'); give it once"));
	CHECK(parse(&o, "requeue=off", err) == 0 && gh_options_parse(&o, "requeue=on", err, 512) < 0 &&
	      strstr(err, "requeue given twice ('off' and 'on')"));
	/* A second call (Slurm calls the callback twice) with the same value, then another. */
	CHECK(parse(&o, "mode=mitigate,report=/r", err) == 0 &&
	      gh_options_parse(&o, "mode=mitigate,report=/r", err, 512) == 0 && !strcmp(o.mode, "mitigate"));
	CHECK(gh_options_parse(&o, "detect", err, 512) < 0 && strstr(err, "mode given twice ('mitigate' and 'detect')"));
	CHECK(parse(&o, "off", err) == 0 && gh_options_parse(&o, "(null)", err, 512) < 0 &&
	      strstr(err, "'on' and 'off' both given"));
	CHECK(parse(&o, NULL, err) == 0 && gh_options_parse(&o, NULL, err, 512) == 0 && o.enabled == 1);
}

/* Messages are the bare cause: the caller says --greyhound or GREYHOUND_OPTIONS. */
static void test_messages(void)
{
	struct gh_options o;
	char err[512];
	char long_value[2000];

	CHECK(parse(&o, "fast", err) < 0 && !strncmp(err, "'fast' is not an option; use off, on", 35));
	CHECK(parse(&o, "mode=fast", err) < 0 && !strncmp(err, "mode='fast'", 11));

	CHECK(parse(&o, "mode=fast", err) < 0 && strstr(err, "mode='fast' is not allowed"));
	CHECK(parse(&o, "colour=red", err) < 0 && strstr(err, "unknown key 'colour'"));
	CHECK(parse(&o, "trace=", err) < 0 && strstr(err, "trace='' is not allowed"));
	CHECK(parse(&o, "requeue=maybe", err) < 0 &&
	      !strcmp(err, "requeue='maybe' is not allowed; use requeue=on or requeue=off"));
	CHECK(parse(&o, "off,requeue=off", err) < 0 && strstr(err, "cannot be combined"));
	CHECK(parse(&o, "colour=red", err) < 0 && strstr(err, "allowed keys: mode, trace, report, requeue"));
	CHECK(parse(&o, ",", err) < 0 && strstr(err, "empty item"));
	CHECK(parse(&o, "off,trace=on", err) < 0 && strstr(err, "cannot be combined"));
	CHECK(parse(&o, "trace=on,trace=off", err) < 0 && strstr(err, "trace given twice"));
	CHECK(parse(&o, "mode=detect\n", err) < 0 && strstr(err, "control character 0x0a"));
	memset(long_value, 'a', sizeof(long_value) - 1);
	long_value[sizeof(long_value) - 1] = '\0';
	CHECK(parse(&o, long_value, err) < 0 && strstr(err, "at most 1024"));
	memcpy(long_value, "report=/", 8);
	long_value[1024] = '\0'; /* exactly the limit: accepted */
	CHECK(parse(&o, long_value, err) == 0 && strlen(o.report) == 1017);
}

/* Admin arguments: defaults first, every key checked, unknown keys refused. */
static void test_admin_arguments(void)
{
	struct gh_config c;
	char err[512];
	char *good[] = { "default=on", "mode=mitigate", "prefix=/opt/gh", "rundir=/scratch/gh", "retain=0",
			 "python=/opt/gh/venv/bin/python" };
	char *bad_key[] = { "defualt=on" };
	char *bad_bool[] = { "default=perhaps" };
	char *bad_path[] = { "rundir=relative" };
	char *bad_paths[] = { "rundir=/", "rundir=/a/../b", "rundir=/a//b", "rundir=/a/.", "rundir=/a/", "prefix=",
			      "python=", "python=bin/python", "python=/opt/../python", "python=/" };
	char *bad_retain[] = { "retain=-1", "retain=7d", "retain=", "retain=3651", "retain= 7", "retain=99999999999" };
	char *no_value[] = { "retain" };
	char *retain_max[] = { "retain=3650" };
	char *requeue_off[] = { "requeue=off" };
	char *requeue_on[] = { "requeue=on" };
	char *requeue_bad[] = { "requeue=x" };
	char *requeue_empty[] = { "requeue=" };

	gh_config_defaults(&c);
	CHECK(c.default_on == 0 && !strcmp(c.mode, "detect") && !strcmp(c.rundir, "/var/tmp/greyhound") &&
	      c.retain_days == 7 && c.python[0] == '\0' && c.requeue == 1);
	CHECK(gh_config_parse(&c, 6, good, err, 512) == 0 && c.default_on == 1 && !strcmp(c.mode, "mitigate") &&
	      !strcmp(c.prefix, "/opt/gh") && !strcmp(c.rundir, "/scratch/gh") && c.retain_days == 0 &&
	      !strcmp(c.python, "/opt/gh/venv/bin/python"));
	CHECK(gh_config_parse(&c, 1, bad_key, err, 512) < 0 &&
	      !strncmp(err, "unknown argument 'defualt=on'; allowed: default=on|off", 52));
	CHECK(gh_config_parse(&c, 1, bad_bool, err, 512) < 0 && strstr(err, "default='perhaps' is not allowed"));
	CHECK(gh_config_parse(&c, 1, bad_path, err, 512) < 0 && strstr(err, "rundir='relative' must be an absolute path"));
	CHECK(gh_config_parse(&c, 1, bad_paths + 7, err, 512) < 0 &&
	      !strncmp(err, "python='bin/python' must be an absolute path other than /", 57));
	for (size_t i = 0; i < sizeof(bad_paths) / sizeof(bad_paths[0]); i++)
		CHECK(gh_config_parse(&c, 1, bad_paths + i, err, 512) < 0 && strstr(err, "must be an absolute path"));
	for (size_t i = 0; i < sizeof(bad_retain) / sizeof(bad_retain[0]); i++)
		CHECK(gh_config_parse(&c, 1, bad_retain + i, err, 512) < 0 &&
		      strstr(err, "use a whole number of days from 0 to 3650"));
	CHECK(gh_config_parse(&c, 1, no_value, err, 512) < 0 && strstr(err, "unknown argument 'retain'"));
	CHECK(gh_config_parse(&c, 1, retain_max, err, 512) == 0 && c.retain_days == 3650);
	CHECK(gh_config_parse(&c, 1, requeue_off, err, 512) == 0 && c.requeue == 0);
	CHECK(gh_config_parse(&c, 1, requeue_on, err, 512) == 0 && c.requeue == 1);
	CHECK(gh_config_parse(&c, 1, requeue_bad, err, 512) < 0 &&
	      !strcmp(err, "requeue='x' is not allowed; use on or off"));
	CHECK(gh_config_parse(&c, 1, requeue_empty, err, 512) < 0 &&
	      !strcmp(err, "requeue='' is not allowed; use on or off"));
	CHECK(gh_config_parse(&c, 1, bad_key, err, 512) < 0 && strstr(err, "python=PATH, requeue=on|off"));
	/* Found by scripts/fuzz-options: a control character in an argument was echoed
	 * into the message, splitting the "one line" (log injection). */
	{
		char *newline[] = { "mode=detect", "rundir=/a/../x\n:/b dir" };

		CHECK(gh_config_parse(&c, 2, newline, err, 512) < 0 && strchr(err, '\n') == NULL &&
		      strstr(err, "argument 2: control character 0x0a at position 15"));
	}
}

/* Precedence: the user's option over the admin's default. */
static void test_precedence(void)
{
	struct gh_options o;
	struct gh_config c;
	char err[512];

	gh_config_defaults(&c);
	c.default_on = 1;
	gh_options_defaults(&o);
	CHECK(gh_enabled(&c, &o) == 1 && !strcmp(gh_effective_mode(&c, &o), "detect"));
	parse(&o, "off", err);
	CHECK(gh_enabled(&c, &o) == 0);
	c.default_on = 0;
	parse(&o, "mitigate", err);
	CHECK(gh_enabled(&c, &o) == 1 && !strcmp(gh_effective_mode(&c, &o), "mitigate"));
}

/* S4: on by default; the user may turn it off, not on where the admin turned it off. */
static void test_requeue_precedence(void)
{
	struct gh_options o;
	struct gh_config c;
	char err[512];

	gh_config_defaults(&c);
	gh_options_defaults(&o);
	CHECK(gh_effective_requeue(&c, &o) == 1);
	parse(&o, "requeue=off", err);
	CHECK(gh_effective_requeue(&c, &o) == 0);
	parse(&o, "requeue=on", err);
	CHECK(gh_effective_requeue(&c, &o) == 1);
	c.requeue = 0;
	CHECK(gh_effective_requeue(&c, &o) == 0); /* admin off wins over the user's on */
	parse(&o, "mitigate", err);
	CHECK(gh_effective_requeue(&c, &o) == 0);
	parse(&o, "requeue=off", err);
	CHECK(gh_effective_requeue(&c, &o) == 0);
}

int main(void)
{
	test_flag_forms();
	test_repeated_settings();
	test_messages();
	test_admin_arguments();
	test_precedence();
	test_requeue_precedence();

	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
