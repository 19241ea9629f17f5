/*
 * Parsing of both configuration channels. Pure string handling: no Slurm calls and no
 * logging (errors come back as the bare cause, and each caller says where the value
 * came from), so it can be tested and fuzzed alone (tests/c/, tests/fuzz/).
 */
#define _GNU_SOURCE /* strchrnul */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "greyhound.h"

#define GH_OPTION_KEYS "mode, trace, report, requeue"

static int parse_bool(const char *value)
{
	if (!strcmp(value, "1") || !strcmp(value, "on") || !strcmp(value, "true") ||
	    !strcmp(value, "yes") || !strcmp(value, "y"))
		return 1;
	if (!strcmp(value, "0") || !strcmp(value, "off") || !strcmp(value, "false") ||
	    !strcmp(value, "no") || !strcmp(value, "n"))
		return 0;
	return -1;
}

static int valid_mode(const char *value)
{
	return !strcmp(value, "detect") || !strcmp(value, "mitigate");
}

static int copy_string(char *dst, size_t dst_len, const char *src)
{
	int n = snprintf(dst, dst_len, "%s", src);

	return (n < 0 || (size_t)n >= dst_len) ? -1 : 0;
}

/* --- admin configuration: plugstack.conf arguments ----------------------------- */

void gh_config_defaults(struct gh_config *config)
{
	memset(config, 0, sizeof(*config));
	config->default_on = 0;
	strcpy(config->mode, "detect");
	strcpy(config->prefix, "/usr/local");
	strcpy(config->rundir, "/var/tmp/greyhound");
	config->python[0] = '\0'; /* none: the control plane is not started */
	config->retain_days = GH_RETAIN_DAYS_DEFAULT;
	config->requeue = 1;
}

#define FAIL(...)                                    \
	do {                                         \
		snprintf(err, err_len, __VA_ARGS__); \
		goto fail;                           \
	} while (0)

enum config_key { KEY_DEFAULT, KEY_MODE, KEY_PREFIX, KEY_RUNDIR, KEY_RETAIN, KEY_PYTHON, KEY_REQUEUE };

static const struct {
	const char *name;
	enum config_key key;
} config_keys[] = {
	{ "default", KEY_DEFAULT },
	{ "mode", KEY_MODE },
	{ "prefix", KEY_PREFIX },
	{ "rundir", KEY_RUNDIR },
	{ "retain", KEY_RETAIN },
	{ "python", KEY_PYTHON },
	{ "requeue", KEY_REQUEUE },
};

#define CONFIG_KEYS_ALLOWED                                                                    \
	"default=on|off, mode=detect|mitigate, prefix=DIR, rundir=DIR, retain=DAYS, python=PATH, " \
	"requeue=on|off"

/* An absolute path, no empty, '.' or '..' component, not "/" itself. */
static int valid_abs_path(const char *value)
{
	const char *p = value;

	if (value[0] != '/' || value[1] == '\0')
		return 0;
	while (*p == '/') {
		const char *comp = p + 1, *end = strchrnul(comp, '/');
		size_t len = (size_t)(end - comp);

		if (len == 0 || (len == 1 && comp[0] == '.') || (len == 2 && comp[0] == '.' && comp[1] == '.'))
			return 0;
		p = end;
	}
	return 1;
}

/* Whole days, 0..GH_RETAIN_DAYS_MAX, digits only (no sign, no blanks, no suffix). */
static int parse_days(const char *value)
{
	int days = 0;

	if (value[0] == '\0')
		return -1;
	for (const char *p = value; *p; p++) {
		if (*p < '0' || *p > '9')
			return -1;
		days = days * 10 + (*p - '0');
		if (days > GH_RETAIN_DAYS_MAX)
			return -1;
	}
	return days;
}

/*
 * Parses the plugstack.conf arguments into config (defaults first, see
 * gh_config_defaults); on error returns -1 with the bare cause in err: the caller
 * says where it came from.
 */
int gh_config_parse(struct gh_config *config, int ac, char **av, char *err, size_t err_len)
{
	for (int i = 0; i < ac; i++) {
		const char *eq = strchr(av[i], '=');
		size_t key_len = eq ? (size_t)(eq - av[i]) : 0;
		const char *value = eq ? eq + 1 : NULL;
		size_t k;

		/* Messages quote the argument: it must not break the one-line message. */
		for (const char *c = av[i]; *c; c++) {
			if (iscntrl((unsigned char)*c))
				FAIL("argument %d: control character 0x%02x at position %zu; only printable characters are allowed",
				     i + 1, (unsigned char)*c, (size_t)(c - av[i]) + 1);
		}
		for (k = 0; k < sizeof(config_keys) / sizeof(config_keys[0]); k++) {
			if (eq && strlen(config_keys[k].name) == key_len &&
			    !strncmp(av[i], config_keys[k].name, key_len))
				break;
		}
		if (k == sizeof(config_keys) / sizeof(config_keys[0]))
			FAIL("unknown argument '%s'; allowed: " CONFIG_KEYS_ALLOWED, av[i]);
		switch (config_keys[k].key) {
		case KEY_DEFAULT:
			if ((config->default_on = parse_bool(value)) < 0)
				FAIL("default='%s' is not allowed; use on or off", value);
			break;
		case KEY_MODE:
			if (!valid_mode(value) || copy_string(config->mode, sizeof(config->mode), value) < 0)
				FAIL("mode='%s' is not allowed; use detect or mitigate", value);
			break;
		case KEY_PREFIX:
		case KEY_RUNDIR:
		case KEY_PYTHON: {
			char *dst = config_keys[k].key == KEY_PREFIX ? config->prefix :
				    config_keys[k].key == KEY_RUNDIR ? config->rundir : config->python;

			if (!valid_abs_path(value) || copy_string(dst, PATH_MAX, value) < 0)
				FAIL("%s='%s' must be an absolute path other than /, without empty, '.' or '..' components, shorter than %d characters",
				     config_keys[k].name, value, PATH_MAX);
			break;
		}
		case KEY_RETAIN:
			if ((config->retain_days = parse_days(value)) < 0)
				FAIL("retain='%s' is not allowed; use a whole number of days from 0 to %d", value,
				     GH_RETAIN_DAYS_MAX);
			break;
		case KEY_REQUEUE:
			if ((config->requeue = parse_bool(value)) < 0)
				FAIL("requeue='%s' is not allowed; use on or off", value);
			break;
		}
	}
	return 0;
fail:
	return -1;
}

/* --- user options: --greyhound=OPTIONS ---------------------------------------- */

void gh_options_defaults(struct gh_options *options)
{
	memset(options, 0, sizeof(*options));
	options->enabled = -1;
	options->trace = -1;
	options->requeue = -1;
}

/*
 * Every setting may be given twice with the same value (Slurm can call the option
 * callback twice, and "detect,mode=detect" says one thing); a different second value
 * is refused, never silently overridden.
 */
static int set_enabled(struct gh_options *options, int on, char *err, size_t err_len)
{
	if (options->enabled >= 0 && options->enabled != on)
		FAIL("'on' and 'off' both given; give one of them");
	options->enabled = on;
	return 0;
fail:
	return -1;
}

static int set_mode(struct gh_options *options, const char *value, char *err, size_t err_len)
{
	if (!valid_mode(value))
		FAIL("mode='%s' is not allowed; use mode=detect or mode=mitigate", value);
	if (options->mode[0] && strcmp(options->mode, value))
		FAIL("mode given twice ('%s' and '%s'); give it once", options->mode, value);
	strcpy(options->mode, value);
	return 0;
fail:
	return -1;
}

/* key=on|off into *slot (-1 unset, 0 off, 1 on). */
static int set_switch(int *slot, const char *key, const char *value, char *err, size_t err_len)
{
	int on = parse_bool(value);

	if (on < 0)
		FAIL("%s='%s' is not allowed; use %s=on or %s=off", key, value, key, key);
	if (*slot >= 0 && *slot != on)
		FAIL("%s given twice ('%s' and '%s'); give it once", key, *slot ? "on" : "off", on ? "on" : "off");
	*slot = on;
	return 0;
fail:
	return -1;
}

static int parse_item(struct gh_options *options, char *item, char *err, size_t err_len)
{
	char *value = strchr(item, '=');

	if (!value) {
		if (!strcmp(item, "off"))
			return set_enabled(options, 0, err, err_len);
		if (!strcmp(item, "on"))
			return set_enabled(options, 1, err, err_len);
		if (valid_mode(item))
			return set_mode(options, item, err, err_len);
		FAIL("'%s' is not an option; use off, on, detect, mitigate or key=value with keys " GH_OPTION_KEYS,
		     item);
	}
	*value++ = '\0';
	if (!strcmp(item, "mode"))
		return set_mode(options, value, err, err_len);
	if (!strcmp(item, "trace"))
		return set_switch(&options->trace, "trace", value, err, err_len);
	if (!strcmp(item, "requeue"))
		return set_switch(&options->requeue, "requeue", value, err, err_len);
	if (!strcmp(item, "report")) {
		if (value[0] != '/')
			FAIL("report='%s' must be an absolute directory path", value);
		if (strlen(value) >= sizeof(options->report))
			FAIL("report path is longer than %d characters", PATH_MAX - 1);
		if (options->report[0] && strcmp(options->report, value))
			FAIL("report given twice, with different directories; give it once");
		strcpy(options->report, value);
		return 0;
	}
	FAIL("unknown key '%s'; allowed keys: " GH_OPTION_KEYS, item);
fail:
	return -1;
}

/*
 * Parses OPTIONS into options (which may already hold an earlier call's settings);
 * on error returns -1 with the bare cause in err, one line: the caller says where
 * the value came from (the flag, GREYHOUND_OPTIONS). NULL, "" and "(null)" (how
 * Slurm forwards a bare optional-argument flag) mean "on".
 */
int gh_options_parse(struct gh_options *options, const char *value, char *err, size_t err_len)
{
	char *copy = NULL, *item, *save = NULL;
	size_t len;
	int rv = -1;

	options->seen = 1;
	if (value == NULL || value[0] == '\0' || !strcmp(value, "(null)"))
		return set_enabled(options, 1, err, err_len);
	len = strlen(value);
	if (len > GH_OPTION_MAX_LEN)
		FAIL("the value is %zu characters long; at most %d are allowed", len, GH_OPTION_MAX_LEN);
	for (size_t i = 0; i < len; i++) {
		if (iscntrl((unsigned char)value[i]))
			FAIL("control character 0x%02x at position %zu; only printable characters are allowed",
			     (unsigned char)value[i], i + 1);
	}
	if (value[len - 1] == ',' || value[0] == ',' || strstr(value, ",,"))
		FAIL("empty item in '%s'; separate key=value items with single commas", value);
	if ((copy = strdup(value)) == NULL)
		FAIL("out of memory");
	for (item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
		if (parse_item(options, item, err, err_len) < 0)
			goto fail;
	}
	if (options->enabled == 0 &&
	    (options->mode[0] || options->trace >= 0 || options->requeue >= 0 || options->report[0]))
		FAIL("'off' cannot be combined with other settings");
	if (options->enabled < 0)
		options->enabled = 1;
	rv = 0;
fail:
	free(copy);
	return rv;
}

int gh_enabled(const struct gh_config *config, const struct gh_options *options)
{
	if (config->broken)
		return 0;
	if (options->seen && options->enabled >= 0)
		return options->enabled;
	return config->default_on;
}

const char *gh_effective_mode(const struct gh_config *config, const struct gh_options *options)
{
	return options->mode[0] ? options->mode : config->mode;
}

/*
 * Whether S4 (checkpoint and requeue the job without the slow node) may run: the
 * user may turn it off for a job, but not on where the admin turned it off. Admin off
 * wins: a requeue gives up the job's nodes and queues it again, a scheduling decision
 * that is the cluster's to forbid.
 */
int gh_effective_requeue(const struct gh_config *config, const struct gh_options *options)
{
	if (!config->requeue)
		return 0;
	return options->requeue != 0;
}
