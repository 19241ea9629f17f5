/*
 * libFuzzer harness for the SPANK plugin's parsers of untrusted text: the user's
 * --greyhound=OPTIONS / GREYHOUND_OPTIONS (gh_options_parse, also called twice, as
 * Slurm may), the admin's plugstack arguments (gh_config_parse) and the search-path
 * rewriting of the user's PYTHONPATH / LD_PRELOAD (gh_path_prepend). Built and run
 * by scripts/fuzz-options with ASan and UBSan; not part of CI.
 *
 * Besides memory errors it checks what callers rely on, and aborts (a finding) when
 * it does not hold: the result is within its documented domain, and an error is one
 * non-empty printable line, the bare cause (the caller adds "--greyhound: " etc.).
 *
 * The parsers call no Slurm function, so no stand-ins are needed; <slurm/spank.h>
 * is only read for its types.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "greyhound.h"

#define CHECK(cond)                                                            \
	do {                                                                   \
		if (!(cond)) {                                                 \
			fprintf(stderr, "invariant broken: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
			abort();                                               \
		}                                                              \
	} while (0)

static void check_err(const char *err, size_t err_len)
{
	size_t len = strnlen(err, err_len);

	CHECK(len > 0 && len < err_len);
	CHECK(strncmp(err, "--greyhound", 11) != 0 && strncmp(err, "greyhound:", 10) != 0);
	for (size_t i = 0; i < len; i++)
		CHECK((unsigned char)err[i] >= 0x20 && err[i] != 0x7f);
}

static int valid_mode(const char *mode)
{
	return !strcmp(mode, "detect") || !strcmp(mode, "mitigate");
}

static void fuzz_options(const char *a, const char *b)
{
	struct gh_options o;
	char err[GH_ERR_LEN];
	int rc;

	gh_options_defaults(&o);
	err[0] = '\0';
	rc = gh_options_parse(&o, a, err, sizeof(err));
	if (rc == 0 && b) /* a second callback: the flag given twice, or Slurm calling again */
		rc = gh_options_parse(&o, b, err, sizeof(err));
	CHECK(rc == 0 || rc == -1);
	CHECK(o.seen == 1);
	if (rc < 0) {
		check_err(err, sizeof(err));
		return;
	}
	CHECK(o.enabled == 0 || o.enabled == 1);
	CHECK(o.trace >= -1 && o.trace <= 1);
	CHECK(o.requeue >= -1 && o.requeue <= 1);
	CHECK(o.mode[0] == '\0' || valid_mode(o.mode));
	CHECK(strnlen(o.report, sizeof(o.report)) < sizeof(o.report));
	CHECK(o.report[0] == '\0' || o.report[0] == '/');
	CHECK(o.enabled == 1 || (o.mode[0] == '\0' && o.trace < 0 && o.requeue < 0 && o.report[0] == '\0'));
	/* The same value again is always accepted, and changes nothing. */
	{
		struct gh_options again = o;

		CHECK(gh_options_parse(&again, a, err, sizeof(err)) == 0);
		CHECK(!memcmp(&again, &o, sizeof(o)));
	}
}

static void fuzz_config(char *text)
{
	char *av[16], *save = NULL, *word;
	struct gh_config c;
	char err[GH_ERR_LEN];
	int ac = 0;

	for (word = strtok_r(text, " \t", &save); word && ac < 16; word = strtok_r(NULL, " \t", &save))
		av[ac++] = word;
	gh_config_defaults(&c);
	err[0] = '\0';
	if (gh_config_parse(&c, ac, av, err, sizeof(err)) < 0) {
		check_err(err, sizeof(err));
		return;
	}
	CHECK(c.default_on == 0 || c.default_on == 1);
	CHECK(valid_mode(c.mode));
	CHECK(c.prefix[0] == '/' && c.rundir[0] == '/' && strcmp(c.rundir, "/") != 0);
	CHECK(strstr(c.rundir, "//") == NULL && strstr(c.rundir, "/../") == NULL);
	CHECK(c.python[0] == '\0' || (c.python[0] == '/' && strcmp(c.python, "/") != 0 && !strstr(c.python, "//")));
	CHECK(c.retain_days >= 0 && c.retain_days <= GH_RETAIN_DAYS_MAX);
	CHECK(c.requeue == 0 || c.requeue == 1);
}

static void fuzz_path(const char *entry, const char *current, int ld_preload)
{
	const char *seps = ld_preload ? ": " : ":";
	size_t entry_len = strlen(entry), current_len = strlen(current);
	char out[512];

	if (entry_len == 0 || strpbrk(entry, seps))
		return; /* greyhound's own entry: a path without separators */
	if (gh_path_prepend(out, sizeof(out), entry, current, seps) < 0) {
		CHECK(entry_len + 1 + current_len >= sizeof(out));
		return;
	}
	CHECK(!strncmp(out, entry, entry_len));
	if (current_len == 0) {
		CHECK(out[entry_len] == '\0');
		return;
	}
	/* Without a copy of our entry in it, the user's value follows exactly. */
	{
		int has_copy = 0;

		for (const char *p = current;;) {
			size_t len = strcspn(p, seps);

			has_copy |= len == entry_len && !strncmp(p, entry, len);
			if (!p[len])
				break;
			p += len + 1;
		}
		if (!has_copy)
			CHECK(out[entry_len] == ':' && !strcmp(out + entry_len + 1, current));
		else
			CHECK(strlen(out) <= entry_len + 1 + current_len);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *text, *second;
	uint8_t target;

	if (size < 1)
		return 0;
	target = data[0];
	if ((text = malloc(size)) == NULL)
		return 0;
	memcpy(text, data + 1, size - 1);
	text[size - 1] = '\0'; /* the parsers take C strings: up to the first NUL */
	second = strchr(text, '\n');
	switch (target % 4) {
	case 0:
		fuzz_options(text, NULL);
		break;
	case 1: /* two callbacks: the value before the first newline, then the rest */
		if (second)
			*second++ = '\0';
		fuzz_options(text, second);
		break;
	case 2:
		fuzz_config(text);
		break;
	default: /* greyhound's entry, newline, the user's value */
		if (second) {
			*second++ = '\0';
			fuzz_path(text, second, target & 4);
		}
		break;
	}
	free(text);
	return 0;
}
