/*
 * greyhound hook: the clock behind every record's timestamps.
 *
 * Records carry CLOCK_MONOTONIC nanoseconds. Reading that clock through
 * clock_gettime costs 45-70 ns in a VM, and the hook reads it twice per
 * intercepted call, so on x86_64 with an invariant TSC that the kernel itself
 * trusts (its clocksource is "tsc") the hook reads the TSC instead and maps it
 * onto CLOCK_MONOTONIC with a line fitted against clock_gettime:
 *
 *     ns = ns0 + (tsc - tsc0) * mult / 2^32
 *
 * The line is refitted from time to time (1 ms after the first calibration,
 * then at doubling intervals up to 100 ms, a refit costing ~0.5 us): each
 * refit takes a fresh (TSC, CLOCK_MONOTONIC) pair, measures the slope over the
 * time since the previous pair (so it follows NTP's frequency corrections),
 * and re-anchors. The mapping never steps back: if the old line ran ahead of
 * the clock, the new one starts where the old one is and runs slightly slower
 * until it meets the clock again. The error against clock_gettime is the
 * width of a calibration pair plus what NTP slews within one interval: tens
 * of ns, rarely a microsecond or two (tests/test_hook_clock.py bounds it;
 * tests/hook_progs/clock_threads.c measures it). A pair whose brackets were
 * all wide (the vCPU descheduled inside each) is not used; the line is kept
 * 10 ms more, at most 8 times in a row.
 *
 * Readers take no lock: the parameters sit behind a sequence counter, and a
 * reader that sees it change or odd (a refit in progress), or finds the line
 * due for a refit, goes to the slow path, where one thread at a time refits
 * and the others read clock_gettime. Before the first calibration, on other
 * architectures, with GREYHOUND_CLOCK=monotonic, or after the TSC misbehaved
 * (a slope off by more than 1 %, time going backwards), every reading goes to
 * clock_gettime, as it did before this file existed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define CAL_FIRST_NS 1000000ull          /* first fit after 1 ms of clock_gettime */
#define CAL_MAX_NS 100000000ull          /* then refits at most 100 ms apart */
#define CAL_PAIR_TRIES 5
#define CAL_MAX_ERROR_NS 1000000ll       /* a refit finding the line 1 ms off: TSC is not usable */
#define CAL_RETRY_NS 10000000ull         /* after a wide calibration bracket, try again in 10 ms */
#define CAL_MAX_SKIPS 8                  /* ... at most this many times in a row */

struct gh_clock gh_clock;
__thread uint64_t gh_last_ns __attribute__((tls_model("initial-exec")));

/* Writer-only state (held under `busy`). */
static struct {
	int busy;                /* try-lock of the refit */
	uint64_t cal_tsc;        /* the last calibration pair, as measured */
	uint64_t cal_ns;
	uint64_t interval_ns;    /* time to the next refit */
	int have_pair;
	uint64_t min_width;      /* narrowest calibration bracket seen (ticks) */
	int skipped;             /* refits put off in a row for a wide bracket */
} w;

#if defined(__x86_64__)
static inline uint64_t tsc_ordered(void)
{
	/* lfence: the read is not moved before earlier instructions (calibration only). */
	__builtin_ia32_lfence();
	return __rdtsc();
}

/* Does /proc/cpuinfo's first flags line name every word of want? */
static int cpu_flags_have(const char *const *want, int n)
{
	char buf[16384];
	ssize_t len;
	int fd = open("/proc/cpuinfo", O_RDONLY | O_CLOEXEC);
	char *line, *end;

	if (fd < 0)
		return 0;
	len = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (len <= 0)
		return 0;
	buf[len] = '\0';
	line = strstr(buf, "\nflags");
	if (!line)
		return 0;
	end = strchr(line + 1, '\n');
	if (end)
		*end = '\0';
	for (int i = 0; i < n; i++) {
		char word[32];
		size_t k = strlen(want[i]);
		char *p = line;
		int found = 0;

		if (k + 3 > sizeof(word))
			return 0;
		word[0] = ' ';
		memcpy(word + 1, want[i], k);
		word[k + 1] = '\0';
		while ((p = strstr(p, word)) != NULL) {
			if (p[k + 1] == ' ' || p[k + 1] == '\0') {
				found = 1;
				break;
			}
			p += k + 1;
		}
		if (!found)
			return 0;
	}
	return 1;
}

/* The kernel's own clocksource: if it gave up on the TSC, so does the hook. */
static int kernel_trusts_tsc(void)
{
	char buf[64];
	ssize_t len;
	int fd = open("/sys/devices/system/clocksource/clocksource0/current_clocksource",
		      O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return 1; /* no sysfs (a container): the CPU flags decide */
	len = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (len <= 0)
		return 1;
	buf[len] = '\0';
	return strncmp(buf, "tsc\n", 4) == 0 || strcmp(buf, "tsc") == 0;
}

static int tsc_usable(void)
{
	static const char *const flags[] = { "constant_tsc", "nonstop_tsc" };
	unsigned a, b, c, d;
	int invariant = __get_cpuid(0x80000007, &a, &b, &c, &d) && (d & (1u << 8));

	return (invariant || cpu_flags_have(flags, 2)) && kernel_trusts_tsc();
}

/*
 * A (TSC, CLOCK_MONOTONIC) pair: the narrowest of a few brackets. Returns its
 * width in ticks (the pair's uncertainty), UINT64_MAX if none was usable.
 */
static uint64_t take_pair(uint64_t *tsc, uint64_t *ns)
{
	uint64_t best = UINT64_MAX;

	for (int i = 0; i < CAL_PAIR_TRIES; i++) {
		uint64_t a = tsc_ordered();
		uint64_t m = gh_mono_ns();
		uint64_t b = tsc_ordered();

		if (b >= a && b - a < best) {
			best = b - a;
			*tsc = a + (b - a) / 2;
			*ns = m;
		}
	}
	if (best == UINT64_MAX) { /* the TSC went backwards in every bracket */
		*tsc = 0;
		*ns = gh_mono_ns();
	}
	if (best < w.min_width || w.min_width == 0)
		w.min_width = best;
	return best;
}
#endif

/* Publishes new parameters (called with the try-lock held). */
static void publish(uint64_t tsc0, uint64_t ns0, uint64_t mult, uint64_t refresh_ticks)
{
	uint32_t s = __atomic_load_n(&gh_clock.seq, __ATOMIC_RELAXED);

	__atomic_store_n(&gh_clock.seq, s + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	__atomic_store_n(&gh_clock.tsc0, tsc0, __ATOMIC_RELAXED);
	__atomic_store_n(&gh_clock.ns0, ns0, __ATOMIC_RELAXED);
	__atomic_store_n(&gh_clock.mult, mult, __ATOMIC_RELAXED);
	__atomic_store_n(&gh_clock.refresh_ticks, refresh_ticks, __ATOMIC_RELAXED);
	__atomic_store_n(&gh_clock.seq, s + 2, __ATOMIC_RELEASE);
}

static void give_up_tsc(void)
{
	/* refresh_ticks 0: every reading takes the slow path, which reads clock_gettime. */
	__atomic_store_n(&gh_clock.mode, GH_CLOCK_SYSTEM, __ATOMIC_RELAXED);
	publish(0, 0, 0, 0);
	if (gh_hdr)
		__atomic_fetch_and(&gh_hdr->hook_flags, ~GH_HOOK_TSC, __ATOMIC_RELAXED);
}

int gh_clock_init(int allow_tsc)
{
#if defined(__x86_64__)
	/* Called by the thread that opens the ring, before any other records. */
	if (allow_tsc && tsc_usable()) {
		if (gh_clock.mult == 0) {
			/* (A forked child keeps its parent's line and calibration pair.) */
			(void)take_pair(&w.cal_tsc, &w.cal_ns);
			w.have_pair = w.cal_tsc != 0;
			w.interval_ns = CAL_FIRST_NS;
		}
		__atomic_store_n(&gh_clock.mode, GH_CLOCK_TSC, __ATOMIC_RELAXED);
		return 1;
	}
#else
	(void)allow_tsc;
#endif
	__atomic_store_n(&gh_clock.mode, GH_CLOCK_SYSTEM, __ATOMIC_RELAXED);
	publish(0, 0, 0, 0);
	return 0;
}

void gh_clock_atfork_child(void)
{
	/* The refit lock may belong to a thread that does not exist in the child. */
	w.busy = 0;
}

#if defined(__x86_64__)
/* Where the published line puts a tick (writer side, under the lock). */
static uint64_t line_at(uint64_t tsc)
{
	return gh_clock.ns0 + (uint64_t)(((unsigned __int128)(tsc - gh_clock.tsc0) * gh_clock.mult) >> 32);
}

/* Ticks in interval_ns at a slope. */
static uint64_t ticks_for(uint64_t interval_ns, uint64_t mult)
{
	return (uint64_t)(((unsigned __int128)interval_ns << 32) / mult);
}

/* The slope (ns per tick, times 2^32) from the calibration pair to (tsc, ns). */
static uint64_t slope_since_pair(uint64_t tsc, uint64_t ns)
{
	unsigned __int128 q = ((unsigned __int128)(ns - w.cal_ns) << 32) / (tsc - w.cal_tsc);

	return q > UINT64_MAX ? UINT64_MAX : (uint64_t)q;
}

/* The first line: the slope since the pair taken at init. Lock held. */
static uint64_t first_fit(uint64_t tsc, uint64_t ns)
{
	uint64_t mult = slope_since_pair(tsc, ns);

	if (mult == 0 || mult == UINT64_MAX) {
		give_up_tsc();
		return ns;
	}
	publish(tsc, ns, mult, ticks_for(w.interval_ns, mult));
	if (gh_hdr)
		__atomic_fetch_or(&gh_hdr->hook_flags, GH_HOOK_TSC, __ATOMIC_RELAXED);
	w.cal_tsc = tsc;
	w.cal_ns = ns;
	return ns;
}

/*
 * A new line through (tsc, ns) at slope mult, for twice the last interval;
 * returns the reading to hand out. Lock held.
 */
static uint64_t next_line(uint64_t tsc, uint64_t ns, uint64_t mult)
{
	uint64_t mapped = line_at(tsc), slow, ticks;
	int64_t err = (int64_t)(mapped - ns);

	if (err > CAL_MAX_ERROR_NS || err < -CAL_MAX_ERROR_NS) {
		give_up_tsc();
		return ns;
	}
	w.interval_ns = w.interval_ns * 2 > CAL_MAX_NS ? CAL_MAX_NS : w.interval_ns * 2;
	ticks = ticks_for(w.interval_ns, mult);
	if (err <= 0) {
		publish(tsc, ns, mult, ticks); /* ran behind (or exact): stepping forward is fine */
		return ns;
	}
	/*
	 * The old line ran ahead: start the new one where the old one is (readings
	 * never step back) and slow it by err over the next interval, by 0.1 % at
	 * most, so that it meets the clock again.
	 */
	slow = (uint64_t)(((unsigned __int128)(uint64_t)err << 32) / ticks);
	if (slow > mult / 1000)
		slow = mult / 1000;
	publish(tsc, mapped, mult - slow, ticks);
	return mapped;
}

/* Refits the line at a fresh pair; returns the reading to hand out. Lock held. */
static uint64_t refit(void)
{
	uint64_t tsc, ns, mult, width;

	width = take_pair(&tsc, &ns);
	if (gh_clock.mult && width > 4 * w.min_width + 64 && w.skipped < CAL_MAX_SKIPS &&
	    tsc > gh_clock.tsc0) {
		/*
		 * Every bracket was wide (the vCPU was descheduled inside each): a
		 * refit now would be off by that much. Keep the line 10 ms more.
		 */
		w.skipped++;
		publish(gh_clock.tsc0, gh_clock.ns0, gh_clock.mult,
			(tsc - gh_clock.tsc0) + ticks_for(CAL_RETRY_NS, gh_clock.mult));
		return line_at(tsc);
	}
	w.skipped = 0;
	if (!w.have_pair) {
		w.cal_tsc = tsc;
		w.cal_ns = ns;
		w.have_pair = tsc != 0;
		return ns;
	}
	if (tsc <= w.cal_tsc || ns < w.cal_ns) {
		give_up_tsc(); /* the TSC (or the clock) went backwards */
		return ns;
	}
	if (gh_clock.mult == 0)
		return first_fit(tsc, ns);
	mult = gh_clock.mult;
	if (ns - w.cal_ns >= CAL_FIRST_NS) {
		/* A baseline long enough for a slope (not so after a fork: keep the old one). */
		uint64_t diff;

		mult = slope_since_pair(tsc, ns);
		diff = mult > gh_clock.mult ? mult - gh_clock.mult : gh_clock.mult - mult;
		if (diff > gh_clock.mult / 100) {
			give_up_tsc(); /* 1 %: no invariant TSC does that, nor NTP (0.05 % at most) */
			return ns;
		}
		w.cal_tsc = tsc;
		w.cal_ns = ns;
	}
	return next_line(tsc, ns, mult);
}
#endif

uint64_t gh_clock_slow(void)
{
#if defined(__x86_64__)
	uint64_t ret;

	if (__atomic_load_n(&gh_clock.mode, __ATOMIC_RELAXED) != GH_CLOCK_TSC ||
	    __atomic_exchange_n(&w.busy, 1, __ATOMIC_ACQUIRE) != 0)
		return gh_mono_ns(); /* no TSC, or another thread is refitting */
	ret = gh_mono_ns();
	if (__atomic_load_n(&gh_clock.mode, __ATOMIC_RELAXED) == GH_CLOCK_TSC &&
	    /* not fitted yet: clock_gettime until the init pair is CAL_FIRST_NS old */
	    !(gh_clock.mult == 0 && w.have_pair && ret - w.cal_ns < w.interval_ns))
		ret = refit();
	__atomic_store_n(&w.busy, 0, __ATOMIC_RELEASE);
	return ret;
#else
	return gh_mono_ns();
#endif
}
