/*
 * What the SPANK plugin makes of plugstack.conf lines, for tests/test_plugstack.py to
 * compare with greyhound/plugstack.py. `plugstack_lines --args ARG...` prints what
 * gh_config_parse makes of ARG... (one line, as below). `plugstack_lines FILE` reads
 * FILE as Slurm reads plugstack.conf (src/common/spank.c: fgets into a PATH_MAX buffer,
 * so a longer line comes in pieces; everything from the first '#' cut; words split on
 * " \t\n", nothing unquoted), and prints one line for each piece:
 *   none                  not a line loading greyhound_spank.so
 *   ok default=.. ...     the settings gh_config_parse made of the arguments
 *   error: CAUSE          gh_config_parse's bare cause
 */
#include <stdio.h>
#include <string.h>

#include "greyhound.h"

#define MAX_WORDS 256

static void parse_args(int ac, char **av)
{
	char err[GH_ERR_LEN] = "";
	struct gh_config c;

	gh_config_defaults(&c);
	if (gh_config_parse(&c, ac, av, err, sizeof(err)) < 0) {
		printf("error: %s\n", err);
		return;
	}
	printf("ok default=%d mode=%s prefix=%s rundir=%s retain=%d python=%s requeue=%d\n", c.default_on, c.mode,
	       c.prefix, c.rundir, c.retain_days, c.python, c.requeue);
}

static void parse_line(char *line)
{
	char *words[MAX_WORDS], *save = NULL, *hash, *base;
	int n = 0;

	if ((hash = strchr(line, '#')))
		*hash = '\0';
	for (char *w = strtok_r(line, " \t\n", &save); w && n < MAX_WORDS; w = strtok_r(NULL, " \t\n", &save))
		words[n++] = w;
	base = n >= 2 ? strrchr(words[1], '/') : NULL;
	base = base ? base + 1 : n >= 2 ? words[1] : "";
	if (n < 2 || (strcmp(words[0], "optional") && strcmp(words[0], "required")) ||
	    strcmp(base, "greyhound_spank.so")) {
		printf("none\n");
		return;
	}
	parse_args(n - 2, words + 2);
}

int main(int argc, char **argv)
{
	char buf[PATH_MAX];
	FILE *fp;

	if (argc >= 2 && !strcmp(argv[1], "--args")) {
		parse_args(argc - 2, argv + 2);
		return 0;
	}
	if (argc != 2 || (fp = fopen(argv[1], "r")) == NULL) {
		fprintf(stderr, "usage: plugstack_lines --args ARG... | plugstack_lines FILE\n");
		return 2;
	}
	while (fgets(buf, sizeof(buf), fp))
		parse_line(buf);
	fclose(fp);
	return 0;
}
