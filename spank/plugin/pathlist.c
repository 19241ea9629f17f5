/*
 * Search-path variables (PYTHONPATH, LD_PRELOAD): put greyhound's entry first and keep
 * the user's value exactly as it was after it. Pure string handling, tested alone
 * (tests/c/test_plugin_pathlist.c).
 *
 * What the user's text means must not change:
 *   - PYTHONPATH: an empty item (a leading or trailing ':', or '::') is the current
 *     directory; a set-but-empty PYTHONPATH adds nothing at all (python skips it),
 *     so "" becomes our entry alone, not "entry:" (which would add the current
 *     directory). Items may contain spaces.
 *   - LD_PRELOAD: items are separated by ':' or ' ' (ld.so(8)); the user's separators
 *     are kept as they were.
 * The only edit to the user's text: an item identical to our entry is dropped (with
 * the separator before it), so that nested steps do not stack copies of it.
 */
#include <string.h>

#include "greyhound.h"

/* Appends len bytes of s to out at *used; -1 when it does not fit (with the NUL). */
static int append(char *out, size_t out_len, size_t *used, const char *s, size_t len)
{
	if (len >= out_len - *used)
		return -1;
	memcpy(out + *used, s, len);
	*used += len;
	out[*used] = '\0';
	return 0;
}

/*
 * out = entry, then ':' and current without the items equal to entry, when any item
 * is left. current NULL (unset) or "" gives entry alone. separators: the characters
 * that separate items in current (":" for PYTHONPATH, ": " for LD_PRELOAD).
 * Returns 0, or -1 when the result does not fit in out_len.
 */
int gh_path_prepend(char *out, size_t out_len, const char *entry, const char *current, const char *separators)
{
	size_t used = 0, entry_len = strlen(entry), num_kept = 0;
	const char *item;

	if (out_len == 0)
		return -1;
	out[0] = '\0';
	if (append(out, out_len, &used, entry, entry_len) < 0 || append(out, out_len, &used, ":", 1) < 0)
		return -1;
	if (current == NULL || current[0] == '\0') {
		out[--used] = '\0'; /* no item at all: our entry alone */
		return 0;
	}
	/* Each kept item goes out with the separator that preceded it in current. */
	for (item = current;;) {
		size_t len = strcspn(item, separators);

		if (!(len == entry_len && !strncmp(item, entry, len))) {
			if (num_kept > 0 && append(out, out_len, &used, item - 1, 1) < 0)
				return -1;
			if (append(out, out_len, &used, item, len) < 0)
				return -1;
			num_kept++;
		}
		if (item[len] == '\0')
			break;
		item += len + 1;
	}
	if (num_kept == 0)
		out[entry_len] = '\0'; /* only copies of our entry: drop the ':' too */
	return 0;
}

/*
 * The inverse of gh_path_prepend for the control plane (controlplane.c), whose
 * processes must not load what greyhound put in front of the user's value: NULL when
 * current is our entry alone (the user had it unset or empty: leave it unset), the
 * user's value exactly as it was when current starts with our entry and its ':', and
 * current itself otherwise (not ours to edit).
 */
const char *gh_path_unprepend(const char *entry, const char *current)
{
	size_t entry_len = strlen(entry);

	if (strncmp(current, entry, entry_len) != 0)
		return current;
	if (current[entry_len] == '\0')
		return NULL;
	if (current[entry_len] == ':')
		return current + entry_len + 1;
	return current;
}
