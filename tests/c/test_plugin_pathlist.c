/*
 * Unit test of gh_path_prepend (spank/plugin/pathlist.c): greyhound's entry first, the
 * user's PYTHONPATH / LD_PRELOAD exactly as it was after it; and of gh_path_unprepend,
 * its inverse for the control plane's processes. Built with ASan/UBSan by
 * tests/test_plugin_config.py. Prints "N passed, N failed".
 */
#include <stdio.h>
#include <string.h>

#include "greyhound.h"

static int passed, failed;

/* gh_path_unprepend gives the user's value back: want NULL = unset. */
static void expect_unprepend(const char *current, const char *want)
{
	const char *got = gh_path_unprepend("/gh/python", current);

	if ((got == NULL && want == NULL) || (got && want && !strcmp(got, want))) {
		passed++;
		return;
	}
	failed++;
	fprintf(stderr, "FAIL: unprepend '%s': got %s, want %s\n", current, got ? got : "NULL", want ? want : "NULL");
}

static void expect(const char *current, const char *separators, const char *want)
{
	char out[256];
	int rc = gh_path_prepend(out, sizeof(out), "/gh/python", current, separators);

	if (rc == 0 && !strcmp(out, want)) {
		passed++;
		return;
	}
	failed++;
	fprintf(stderr, "FAIL: current=%s%s%s sep='%s': got rc=%d '%s', want '%s'\n", current ? "'" : "",
		current ? current : "NULL", current ? "'" : "", separators, rc, rc == 0 ? out : "", want);
}

int main(void)
{
	char small[16];
	const char *py = ":";
	const char *ld = ": ";

	/* Unset: ours alone. Set but empty: python adds nothing for it, so ours alone too. */
	expect(NULL, py, "/gh/python");
	expect("", py, "/gh/python");
	/* Everything else is kept byte for byte: spaces, empty items (the current directory). */
	expect("/a dir with spaces", py, "/gh/python:/a dir with spaces");
	expect(":/lead", py, "/gh/python::/lead");
	expect("/trail:", py, "/gh/python:/trail:");
	expect(":", py, "/gh/python::");
	expect("::", py, "/gh/python:::");
	expect(":/a dir with spaces::/b", py, "/gh/python::/a dir with spaces::/b");
	expect("/x y:/z", ld, "/gh/python:/x y:/z"); /* LD_PRELOAD: the user's blanks stay too */
	expect("libu.so  libv.so", ld, "/gh/python:libu.so  libv.so");
	/* Only an identical copy of our entry goes (nested steps must not stack it). */
	expect("/gh/python", py, "/gh/python");
	expect("/gh/python:/gh/python", py, "/gh/python");
	expect("/gh/python:", py, "/gh/python:"); /* the empty item (cwd) stays */
	expect(":/gh/python", py, "/gh/python:");
	expect("/a:/gh/python:/b", py, "/gh/python:/a:/b");
	expect("/a:/gh/python", py, "/gh/python:/a");
	expect("/gh/python/sub:/gh/pytho:x/gh/python", py, "/gh/python:/gh/python/sub:/gh/pytho:x/gh/python");
	expect("/gh/python /a", py, "/gh/python:/gh/python /a"); /* PYTHONPATH: a space is part of the item */
	expect("/gh/python /a", ld, "/gh/python:/a");           /* LD_PRELOAD: it separates */
	expect("/a /gh/python:/b", ld, "/gh/python:/a:/b");

	/* Too long for the output: -1, never a truncated value. */
	if (gh_path_prepend(small, sizeof(small), "/gh/python", "/abcdef", py) == -1)
		passed++;
	else
		failed++, fprintf(stderr, "FAIL: overflow not reported\n");
	if (gh_path_prepend(small, sizeof(small), "/gh/python", "/abcd", py) == 0 && !strcmp(small, "/gh/python:/abcd"))
		failed++, fprintf(stderr, "FAIL: 16 characters do not fit in 16 bytes\n");
	else
		passed++;
	if (gh_path_prepend(small, sizeof(small), "/gh/python", "/abc", py) == 0 && !strcmp(small, "/gh/python:/abc"))
		passed++;
	else
		failed++, fprintf(stderr, "FAIL: 15 characters fit in 16 bytes\n");

	/* The inverse: whatever the user had, exactly, once our entry comes off. */
	{
		const char *users[] = { "/a dir with spaces", ":/lead", "/trail:", ":", "::", "/x y:/z", "libu.so  libv.so" };

		for (size_t i = 0; i < sizeof(users) / sizeof(users[0]); i++) {
			char out[256];

			gh_path_prepend(out, sizeof(out), "/gh/python", users[i], i < 5 ? py : ld);
			expect_unprepend(out, users[i]);
		}
	}
	expect_unprepend("/gh/python", NULL); /* the user had it unset (or empty): unset */
	/* Not ours in front (a task prolog, the user's own edit): left as it is. */
	expect_unprepend("/a:/gh/python", "/a:/gh/python");
	expect_unprepend("/gh/python2:/a", "/gh/python2:/a");
	expect_unprepend("/gh/python /a", "/gh/python /a");
	expect_unprepend("", "");

	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
