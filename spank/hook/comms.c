/*
 * greyhound hook: the process-local map from communicator handles to ids.
 *
 * Fixed-size open addressing with atomics: lookups are on the hot path and
 * take no lock; inserts happen when a communicator is created or first used.
 * A slot is claimed by CAS on its key and becomes visible when `ready` is set.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "hook.h"

#define MAP_SLOTS 1024u           /* power of two */
#define KEY_EMPTY 0ull
#define KEY_TOMB 1ull

struct slot {
	uint64_t key;      /* handle, or KEY_EMPTY / KEY_TOMB */
	uint32_t source;
	uint32_t ready;
	struct gh_comm_info info;
};

static struct slot map[MAP_SLOTS];

struct ordinal_slot {
	uint64_t key;      /* member hash ^ source, 0 = empty */
	uint32_t count;
};

static struct ordinal_slot ordinals[MAP_SLOTS];

uint64_t gh_comm_gen;
__thread struct gh_comm_last gh_comm_last __attribute__((tls_model("initial-exec")));

/* After a change to the map: every thread's last-used entry is stale. */
static void bump_gen(void)
{
	__atomic_fetch_add(&gh_comm_gen, 1, __ATOMIC_ACQ_REL);
}

static inline uint32_t slot_of(uint64_t key)
{
	key ^= key >> 33;
	key *= 0xff51afd7ed558ccdull;
	key ^= key >> 33;
	return (uint32_t)key & (MAP_SLOTS - 1);
}

/* Handles 0 and 1 (MPICH-style integers) are shifted so they never look empty. */
static inline uint64_t key_of(uint64_t handle)
{
	return handle < 2 ? handle + (1ull << 63) : handle;
}

static struct slot *find(uint8_t source, uint64_t key)
{
	uint32_t i = slot_of(key);

	for (uint32_t n = 0; n < MAP_SLOTS; n++, i = (i + 1) & (MAP_SLOTS - 1)) {
		uint64_t k = __atomic_load_n(&map[i].key, __ATOMIC_ACQUIRE);

		if (k == KEY_EMPTY)
			return NULL;
		if (k == key && map[i].source == source)
			return &map[i];
	}
	return NULL;
}

int gh_comm_lookup_slow(uint8_t source, uint64_t handle, struct gh_comm_info *out)
{
	/* The generation before the lookup: a change during it makes the entry stale. */
	uint64_t gen = __atomic_load_n(&gh_comm_gen, __ATOMIC_ACQUIRE);
	struct slot *s = find(source, key_of(handle));
	struct gh_comm_last *c = &gh_comm_last;

	if (!s || !__atomic_load_n(&s->ready, __ATOMIC_ACQUIRE))
		return 0;
	*out = s->info;
	c->handle = handle;
	c->source = source;
	c->gen = gen;
	c->info = *out;
	c->valid = 1;
	return 1;
}

void gh_comm_insert(uint8_t source, uint64_t handle, const struct gh_comm_info *info)
{
	uint64_t key = key_of(handle);
	struct slot *s = find(source, key);
	uint32_t i = slot_of(key);

	if (s) {
		/* The library reused a handle we did not see freed. */
		__atomic_store_n(&s->ready, 0, __ATOMIC_RELEASE);
		s->info = *info;
		__atomic_store_n(&s->ready, 1, __ATOMIC_RELEASE);
		bump_gen();
		return;
	}
	for (uint32_t n = 0; n < MAP_SLOTS; n++, i = (i + 1) & (MAP_SLOTS - 1)) {
		uint64_t k = __atomic_load_n(&map[i].key, __ATOMIC_ACQUIRE);

		if (k != KEY_EMPTY && k != KEY_TOMB)
			continue;
		if (!__atomic_compare_exchange_n(&map[i].key, &k, key, 0, __ATOMIC_ACQ_REL,
						 __ATOMIC_ACQUIRE))
			continue;
		map[i].source = source;
		map[i].info = *info;
		__atomic_store_n(&map[i].ready, 1, __ATOMIC_RELEASE);
		bump_gen();
		return;
	}
	/* Full: lookups miss and the caller derives the id again; correct, slower. */
	gh_log_once(GH_P_COMM_TABLE, "more than %u live communicators; ids are derived per call",
		    MAP_SLOTS);
}

void gh_comm_remove(uint8_t source, uint64_t handle)
{
	struct slot *s = find(source, key_of(handle));

	if (!s)
		return;
	__atomic_store_n(&s->ready, 0, __ATOMIC_RELEASE);
	__atomic_store_n(&s->key, KEY_TOMB, __ATOMIC_RELEASE);
	bump_gen();
}

void gh_comm_end_done(const struct gh_comm_end *e, int destroyed, int32_t rc)
{
	uint64_t now;

	if (!e->known || !destroyed)
		return;
	gh_comm_remove(e->source, e->handle);
	gh_comm_retire(e->info.comm_id);
	now = gh_now_ns(); /* one reading: start == end, never end < start */
	gh_record(GH_OP_COMM_DESTROY, e->source, e->info.flags, now, now, 0, e->info.comm_id,
		  e->info.rank, 0, rc);
}

uint32_t gh_comm_ordinal(uint8_t source, uint64_t member_hash)
{
	uint64_t key = (member_hash ^ ((uint64_t)source << 56)) | 1ull;
	uint32_t i = slot_of(key);

	for (uint32_t n = 0; n < MAP_SLOTS; n++, i = (i + 1) & (MAP_SLOTS - 1)) {
		uint64_t k = __atomic_load_n(&ordinals[i].key, __ATOMIC_ACQUIRE);

		if (k == KEY_EMPTY &&
		    __atomic_compare_exchange_n(&ordinals[i].key, &k, key, 0, __ATOMIC_ACQ_REL,
						__ATOMIC_ACQUIRE))
			k = key; /* claimed; on failure k holds the winner's key */
		if (k != key)
			continue;
		return __atomic_fetch_add(&ordinals[i].count, 1, __ATOMIC_RELAXED);
	}
	return 0;
}

uint32_t gh_comm_next_split(uint8_t source, uint64_t handle)
{
	struct slot *s = find(source, key_of(handle));

	if (!s)
		return 0;
	return __atomic_fetch_add(&s->info.num_splits, 1, __ATOMIC_RELAXED);
}
