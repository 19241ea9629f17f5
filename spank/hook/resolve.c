/*
 * greyhound hook: finding the real functions behind the interposed names.
 *
 * dlsym(RTLD_NEXT) finds libraries in the global scope. A library opened with
 * RTLD_LOCAL (a Python extension's libmpi or libnccl may be) is not there, so
 * the fallback walks the loaded objects and asks each one, opened with
 * RTLD_NOLOAD: this never loads anything new.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>
#include <string.h>

#include "hook.h"

#define MAX_OBJECTS 512

struct names {
	const char *name[MAX_OBJECTS];
	size_t n;
};

static int collect(struct dl_phdr_info *info, size_t size, void *data)
{
	struct names *names = data;

	(void)size;
	if (info->dlpi_name && info->dlpi_name[0] && names->n < MAX_OBJECTS)
		names->name[names->n++] = info->dlpi_name;
	return 0;
}

static int is_ours(void *p)
{
	Dl_info self, other;

	if (!dladdr((void *)&gh_lookup_loaded, &self) || !dladdr(p, &other))
		return 0;
	return self.dli_fbase == other.dli_fbase;
}

void *gh_lookup_loaded(const char *name)
{
	struct names names = { .n = 0 };
	void *p = dlsym(RTLD_NEXT, name);

	if (p && !is_ours(p))
		return p;
	/* dlopen cannot be called from inside dl_iterate_phdr: collect first. */
	dl_iterate_phdr(collect, &names);
	for (size_t i = 0; i < names.n; i++) {
		void *h = dlopen(names.name[i], RTLD_LAZY | RTLD_NOLOAD);

		if (!h)
			continue;
		p = dlsym(h, name);
		dlclose(h);
		if (p && !is_ours(p))
			return p;
	}
	return NULL;
}

/* The cached case is inline in hook.h: one load per call. */
void *gh_resolve_slow(void **cache, const char *name)
{
	void *p = gh_lookup_loaded(name);

	if (!p) {
		gh_log_once(GH_P_RESOLVE, "%s: no library in this process defines it", name);
		return NULL;
	}
	__atomic_store_n(cache, p, __ATOMIC_RELEASE);
	return p;
}
