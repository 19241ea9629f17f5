/*
 * greyhound.analytics._bocdv: the BOCD+V online loop in C.
 *
 * One Kernel object is one online detector: the BOCD run-length posterior of
 * greyhound/analytics/bocd.py (RunLengthPosterior) and the verification of
 * greyhound/analytics/verify.py (ReferenceBocdV), step for step. The model and every
 * rule are explained in those two modules' docstrings; this file only says where it
 * had to choose how to compute something.
 *
 * Why C: the Python reference costs ~90 us per iteration in many small numpy calls;
 * a DDP rank has ~3 calls per iteration, so detection alone held the analytics to
 * 0.03 M calls/s against a target of 1 M. Here an iteration costs ~2 us.
 *
 * Same numbers as the reference: every expression is evaluated in the reference's
 * order with the same libm functions numpy uses for float64 (exp, log, log1p; numpy
 * calls libm for them where the CPU has no AVX-512), sums are numpy's (a 0.0 start
 * plus its 8-accumulator pairwise sum), medians are exact order statistics, and every
 * derived constant (bocd.derived_constants, VerifyConfig.values_capacity) and the
 * gammaln table (bocd.gamma_ratio_table, scipy) come from the Python side. On such a CPU
 * the posterior is bit-identical to the reference; elsewhere it agrees to rounding.
 * Compile without -ffast-math and with -ffp-contract=off so that stays true.
 *
 * Input is validated by the wrapper (greyhound.analytics.verify.BocdV); the kernel
 * checks again and raises ValueError before it changes any state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* setup.py defines GH_HAVE_MVEC=1 (and links libmvec) on x86_64 Linux. */
#ifndef GH_HAVE_MVEC
#define GH_HAVE_MVEC 0
#endif
#if GH_HAVE_MVEC
#include <immintrin.h>
#endif

/* ---- elementwise exp, log, log1p -------------------------------------------
 * Per iteration the posterior needs five of these per hypothesis (~240 calls), most
 * of an iteration's cost with libm's scalar functions. glibc's libmvec has 4-lane
 * AVX2 versions (within 4 ulp, libm's are within 1) at a quarter of the cost; the
 * kernel uses them where the CPU has AVX2 and FMA. With exact_math it uses libm's,
 * as numpy does, for a posterior bit-identical to the reference's (tests). */

typedef void (*vfunc)(const double *in, double *out, Py_ssize_t n);

static void
exp_libm(const double *in, double *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = exp(in[i]);
}

static void
log_libm(const double *in, double *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = log(in[i]);
}

static void
log1p_libm(const double *in, double *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = log1p(in[i]);
}

#if GH_HAVE_MVEC
/* libmvec's AVX2 entry points (the x86_64 vector ABI names of exp, log, log1p). */
__m256d _ZGVdN4v_exp(__m256d);
__m256d _ZGVdN4v_log(__m256d);
__m256d _ZGVdN4v_log1p(__m256d);

/* The last n % 4 values go through a padded block; `pad` keeps its spare lanes in
 * the function's domain. */
#define GH_VFUNC(name, vec, pad)                                                     \
    __attribute__((target("avx2,fma"))) static void name(const double *in,          \
                                                         double *out, Py_ssize_t n) \
    {                                                                                \
        Py_ssize_t i = 0;                                                            \
        for (; i + 4 <= n; i += 4)                                                   \
            _mm256_storeu_pd(out + i, vec(_mm256_loadu_pd(in + i)));                 \
        if (i < n) {                                                                 \
            double block[4] = {pad, pad, pad, pad};                                  \
            memcpy(block, in + i, (size_t)(n - i) * sizeof(double));                 \
            _mm256_storeu_pd(block, vec(_mm256_loadu_pd(block)));                    \
            memcpy(out + i, block, (size_t)(n - i) * sizeof(double));                 \
        }                                                                            \
    }
GH_VFUNC(exp_mvec, _ZGVdN4v_exp, 0.0)
GH_VFUNC(log_mvec, _ZGVdN4v_log, 1.0)
GH_VFUNC(log1p_mvec, _ZGVdN4v_log1p, 0.0)
#undef GH_VFUNC
#endif

/* Whether this CPU runs the libmvec functions (set at import). */
static int have_mvec;

typedef struct {
    PyObject_HEAD
    /* BOCD constants: greyhound.analytics.bocd.derived_constants, as RunLengthPosterior
     * uses them; nothing is derived here. */
    double log_h, log_1mh, log_eps, log_1m_eps, logpred0_base, prune_factor;
    double kappa_first, alpha_first, mad_per_sigma;
    double alpha0, noise_default, noise_floor, clip, threshold;
    Py_ssize_t max_hyp, noise_window, noise_min_samples;
    /* Verification constants (VerifyConfig). */
    double min_change, keep_prob, max_visited;
    int64_t min_after, max_pending, before_window, creep_window, creep_every;
    int64_t hold_newest, min_before;
    /* gammaln(alpha + 1/2) - gammaln(alpha), alpha = alpha0 + n/2; grown by lg_func. */
    PyObject *lg_func;
    double *lg;
    Py_ssize_t lg_len;
    /* Posterior: aligned arrays of capacity max_hyp + 1, `size` in use. */
    int64_t t;
    Py_ssize_t size;
    int64_t *starts;
    double *kappa, *mu, *alpha, *beta, *logp, *p;
    /* Jitter estimate: the last noise_window |log-differences| as a ring. */
    double *diffs;
    Py_ssize_t diffs_len, diffs_head;
    double prev, sigma;
    int has_prev;
    /* Recent iteration times (RecentValues): stored twice, vcap apart. */
    double *vbuf;
    int64_t vcap, vcount;
    /* Scratch for medians and masked sums; per-hypothesis temporaries. */
    double *scratch;
    Py_ssize_t scratch_len;
    double *ta, *tb, *tc, *td, *te;
    /* exp, log, log1p over arrays: libmvec's or libm's (exact_math). */
    vfunc vexp, vlog, vlog1p;
    int exact_math;
    /* Verification state (ReferenceBocdV). */
    int64_t regime_start, last_candidate, pending, suspicion;
    int has_pending, has_suspicion;
} Kernel;

/* numpy's float64 add.reduce of a contiguous array: the identity 0.0 plus its
 * pairwise sum (8 accumulators in blocks of up to 128). */
static double
pairwise(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double res = -0.0;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise(a, n2) + pairwise(a + n2, n - n2);
}

static double
np_sum(const double *a, Py_ssize_t n)
{
    return 0.0 + pairwise(a, n);
}

/* Quickselect: afterwards a[k] is the k-th smallest and a[i] <= a[k] for i < k. */
static double
select_kth(double *a, Py_ssize_t n, Py_ssize_t k)
{
    Py_ssize_t lo = 0, hi = n - 1;
    while (hi > lo) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        double tmp;
#define SWAP(i, j) (tmp = a[i], a[i] = a[j], a[j] = tmp)
        if (a[mid] < a[lo])
            SWAP(lo, mid);
        if (a[hi] < a[lo])
            SWAP(lo, hi);
        if (a[hi] < a[mid])
            SWAP(mid, hi);
        double pivot = a[mid];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                SWAP(i, j);
                i++;
                j--;
            }
        }
#undef SWAP
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[k];
}

/* Lower and upper median of a[0:n] (n >= 1); reorders a. */
static void
middles(double *a, Py_ssize_t n, double *low, double *high)
{
    Py_ssize_t k = n / 2;
    *high = select_kth(a, n, k);
    if (n % 2) {
        *low = *high;
        return;
    }
    double m = a[0];
    for (Py_ssize_t i = 1; i < k; i++)
        if (a[i] > m)
            m = a[i];
    *low = m;
}

/* np.median: the middle value, or the mean of the two middle values. */
static double
median(double *a, Py_ssize_t n)
{
    double low, high;
    middles(a, n, &low, &high);
    return n % 2 ? high : (low + high) / 2.0;
}

/* ---- recent values (RecentValues) ------------------------------------------- */

static void
values_append(Kernel *k, double x)
{
    int64_t i = k->vcount % k->vcap;
    k->vbuf[i] = k->vbuf[i + k->vcap] = x;
    k->vcount++;
}

/* Values with absolute index in [start, stop), clipped to what is kept. */
static const double *
values_window(const Kernel *k, int64_t start, int64_t stop, Py_ssize_t *n)
{
    int64_t first = k->vcount > k->vcap ? k->vcount - k->vcap : 0;
    int64_t lo = start > first ? start : first;
    int64_t hi = stop < k->vcount ? stop : k->vcount;
    if (hi <= lo) {
        *n = 0;
        return k->vbuf;
    }
    *n = (Py_ssize_t)(hi - lo);
    return k->vbuf + first % k->vcap + (lo - first);
}

/* Copies a window into scratch; returns its length. */
static Py_ssize_t
window_copy(Kernel *k, int64_t start, int64_t stop)
{
    Py_ssize_t n;
    const double *w = values_window(k, start, stop, &n);
    memcpy(k->scratch, w, (size_t)n * sizeof(double));
    return n;
}

/* ---- posterior (RunLengthPosterior) ----------------------------------------- */

static int
grow_table(Kernel *k, Py_ssize_t top)
{
    Py_ssize_t size = 2 * k->lg_len > top + 1 ? 2 * k->lg_len : top + 1;
    PyObject *res = PyObject_CallFunction(k->lg_func, "n", size);
    if (res == NULL)
        return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(res, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        Py_DECREF(res);
        return -1;
    }
    int rv = -1;
    if (view.itemsize != 8 || view.format == NULL || strchr(view.format, 'd') == NULL
        || view.len < size * 8) {
        PyErr_Format(PyExc_TypeError,
                     "greyhound: bocdv kernel: the gammaln table must be >= %zd float64",
                     size);
        goto fail;
    }
    double *lg = PyMem_Realloc(k->lg, (size_t)size * sizeof(double));
    if (lg == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(lg, view.buf, (size_t)size * sizeof(double));
    k->lg = lg;
    k->lg_len = size;
    rv = 0;
fail:
    PyBuffer_Release(&view);
    Py_DECREF(res);
    return rv;
}

static void
normalise(Kernel *k)
{
    Py_ssize_t r = k->size;
    double *logp = k->logp, *p = k->p;
    double top = logp[0];
    for (Py_ssize_t i = 1; i < r; i++)
        if (logp[i] > top)
            top = logp[i];
    for (Py_ssize_t i = 0; i < r; i++)
        p[i] = logp[i] - top;
    k->vexp(p, p, r);
    double total = np_sum(p, r);
    double shift = top + log(total);
    for (Py_ssize_t i = 0; i < r; i++) {
        logp[i] -= shift;
        p[i] = p[i] / total;
    }
}

static void
prune(Kernel *k)
{
    Py_ssize_t r = k->size, n = 0;
    double top = k->p[0];
    for (Py_ssize_t i = 1; i < r; i++)
        if (k->p[i] > top)
            top = k->p[i];
    double floor_p = top * k->prune_factor;
    for (Py_ssize_t i = 0; i < r; i++) {
        if (!(k->p[i] >= floor_p))
            continue;
        k->starts[n] = k->starts[i];
        k->kappa[n] = k->kappa[i];
        k->mu[n] = k->mu[i];
        k->alpha[n] = k->alpha[i];
        k->beta[n] = k->beta[i];
        k->logp[n] = k->logp[i];
        n++;
    }
    if (n == r)
        return;
    k->size = n;
    normalise(k);
}

static double
estimate_noise(Kernel *k)
{
    memcpy(k->scratch, k->diffs, (size_t)k->diffs_len * sizeof(double));
    double mad = median(k->scratch, k->diffs_len);
    double sigma = mad / k->mad_per_sigma;
    return k->noise_floor >= sigma ? k->noise_floor : sigma;
}

/* The gammaln ratio is looked up at t - start for every hypothesis: grows the table
 * (RunLengthPosterior._log_gamma_ratio) when the oldest start is past its end. */
static int
ensure_table(Kernel *k, int64_t t)
{
    Py_ssize_t r = k->size;
    if (r == 0)
        return 0;
    int64_t oldest = k->starts[0];
    for (Py_ssize_t i = 1; i < r; i++)
        if (k->starts[i] < oldest)
            oldest = k->starts[i];
    if (t - oldest >= k->lg_len && grow_table(k, (Py_ssize_t)(t - oldest)) < 0)
        return -1;
    return 0;
}

/* The Student-t predictive's parts, the reference's vector expressions in its order,
 * split where a transcendental function is applied to the whole array. Afterwards
 * ta = log(pi nu scale^2), tb = log1p(z^2 / (nu scale^2)), tc = scale^2, td = z and
 * te = the gammaln ratio. */
static void
predictive(Kernel *k, int64_t t, double y, double beta0)
{
    Py_ssize_t r = k->size;
    const double *restrict kap = k->kappa, *restrict alp = k->alpha, *restrict bet = k->beta;
    const double *restrict mu = k->mu;
    const int64_t *restrict starts = k->starts;
    const double *restrict lg = k->lg;
    double *restrict ta = k->ta, *restrict tb = k->tb, *restrict tc = k->tc;
    double *restrict td = k->td, *restrict te = k->te;
    for (Py_ssize_t i = 0; i < r; i++)
        te[i] = lg[t - starts[i]];
    for (Py_ssize_t i = 0; i < r; i++) {
        double kappa = kap[i], alpha = alp[i];
        double kappa1 = kappa + 1.0;
        double scale_sq = (beta0 + bet[i]) * kappa1 / (alpha * kappa);
        double nu_scale_sq = 2.0 * alpha * scale_sq;
        double z = y - mu[i];
        ta[i] = M_PI * nu_scale_sq;
        tb[i] = z * z / nu_scale_sq;
        tc[i] = scale_sq;
        td[i] = z;
    }
    k->vlog(ta, ta, r);
    k->vlog1p(tb, tb, r);
}

/* logaddexp(logpred + log(1 - eps), outlier) as numpy's npy_logaddexp:
 * max + log1p(exp(-|difference|)), x + log 2 on equality, NaN for NaN. Afterwards ta
 * is the max (or the whole result where te is 1), tb log1p(exp(-|difference|)). */
static void
mix_outlier(Kernel *k, double outlier)
{
    Py_ssize_t r = k->size;
    const double *restrict alp = k->alpha;
    double *restrict ta = k->ta, *restrict tb = k->tb, *restrict te = k->te;
    const double log_1m_eps = k->log_1m_eps;
    for (Py_ssize_t i = 0; i < r; i++) {
        double logpred = te[i] - 0.5 * ta[i] - (alp[i] + 0.5) * tb[i];
        double x = logpred + log_1m_eps;
        double diff = x - outlier;
        int whole = !(diff > 0 || diff < 0);
        double special = x == outlier ? x + 0.693147180559945309417232121458176568 : diff;
        te[i] = whole ? 1.0 : 0.0;
        ta[i] = whole ? special : (diff > 0 ? x : outlier);
        tb[i] = diff > 0 ? -diff : diff;
    }
    k->vexp(tb, tb, r);
    k->vlog1p(tb, tb, r);
}

/* Every hypothesis grows by y: logp gains the mixed predictive and log(1 - h), and
 * the Normal-Gamma statistics take y's z clipped to clip scales. */
static void
grow_hypotheses(Kernel *k)
{
    Py_ssize_t r = k->size;
    double *restrict kap = k->kappa, *restrict alp = k->alpha, *restrict bet = k->beta;
    double *restrict mu = k->mu, *restrict logp = k->logp;
    const double *restrict ta = k->ta, *restrict tb = k->tb, *restrict tc = k->tc;
    const double *restrict td = k->td, *restrict te = k->te;
    const double log_1mh = k->log_1mh, clip = k->clip;
    for (Py_ssize_t i = 0; i < r; i++) {
        double kappa = kap[i];
        double kappa1 = kappa + 1.0;
        double lae = te[i] != 0.0 ? ta[i] : ta[i] + tb[i];
        logp[i] = (logp[i] + lae) + log_1mh;
        double z = td[i];
        double bound = clip * sqrt(tc[i]);
        double zc = z > -bound ? z : -bound;
        zc = zc < bound ? zc : bound;
        bet[i] += kappa * zc * zc / (2.0 * kappa1);
        mu[i] += zc / kappa1;
        kap[i] = kappa1;
        alp[i] += 0.5;
    }
}

/* A new segment starting at t with y as its first point. */
static void
add_segment(Kernel *k, int64_t t, double y, double logpred0)
{
    Py_ssize_t r = k->size, slot = r;
    if (r == k->max_hyp) {
        /* Full: the new segment takes the slot of the least probable (first) one. */
        slot = 0;
        for (Py_ssize_t i = 1; i < r; i++)
            if (k->logp[i] < k->logp[slot])
                slot = i;
    } else {
        k->size = r + 1;
    }
    k->kappa[slot] = k->kappa_first;
    k->mu[slot] = y;
    k->alpha[slot] = k->alpha_first;
    k->beta[slot] = 0.0;
    k->logp[slot] = k->log_h + logpred0;
    k->starts[slot] = t;
}

/* The jitter: |y - previous y| joins the ring; sigma is refreshed every 8
 * observations once there are noise_min_samples. */
static void
track_noise(Kernel *k, int64_t t, double y)
{
    if (k->has_prev) {
        k->diffs[k->diffs_head] = fabs(y - k->prev);
        k->diffs_head = (k->diffs_head + 1) % k->noise_window;
        if (k->diffs_len < k->noise_window)
            k->diffs_len++;
        if (k->diffs_len >= k->noise_min_samples && t % 8 == 0)
            k->sigma = estimate_noise(k);
    }
    k->prev = y;
    k->has_prev = 1;
}

/* One observation y (a log iteration time), as RunLengthPosterior.update. Fails
 * (before changing anything) only when the gammaln table cannot grow. */
static int
posterior_update(Kernel *k, double y)
{
    int64_t t = k->t + 1;
    if (ensure_table(k, t) < 0)
        return -1;
    k->t = t;
    double sigma = k->sigma;
    double beta0 = k->alpha0 * sigma * sigma;
    /* A new segment's first point is its own prior mean: Student-t(2 alpha0) at 0. */
    double logpred0 = k->logpred0_base - log(sigma);
    double outlier = k->log_eps + logpred0;
    predictive(k, t, y, beta0);
    mix_outlier(k, outlier);
    grow_hypotheses(k);
    add_segment(k, t, y, logpred0);
    normalise(k);
    if (t % 16 == 0)
        prune(k);
    track_noise(k, t, y);
    return 0;
}

/* Posterior mass of starts in [first, last] (numpy's sum of the masked array). */
static double
prob_between(Kernel *k, int64_t first, int64_t last)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < k->size; i++)
        if (k->starts[i] >= first && k->starts[i] <= last)
            k->scratch[n++] = k->p[i];
    return np_sum(k->scratch, n);
}

/* The most probable start >= first (the first in slot order on ties); 0 if none. */
static int
most_likely_since(const Kernel *k, int64_t first, int64_t *start)
{
    Py_ssize_t best = -1;
    for (Py_ssize_t i = 0; i < k->size; i++)
        if (k->starts[i] >= first && (best < 0 || k->p[i] > k->p[best]))
            best = i;
    if (best < 0)
        return 0;
    *start = k->starts[best];
    return 1;
}

static int
flagged_start(Kernel *k, int64_t after, int64_t *start)
{
    if (!most_likely_since(k, after + 1, start))
        return 0;
    int64_t lo = *start - 1 > after + 1 ? *start - 1 : after + 1;
    return prob_between(k, lo, *start + 1) >= k->threshold;
}

/* ---- verification (ReferenceBocdV) ------------------------------------------- */

typedef struct {
    int64_t index, detected_at;
    double before, after;
} Change;

/* The new level if a strict majority moved by >= min_change. */
static int
moved(double before, double low, double high, double min_change, double *after)
{
    if (low >= before * (1.0 + min_change)) {
        *after = low;
        return 1;
    }
    if (high <= before * (1.0 - min_change)) {
        *after = high;
        return 1;
    }
    return 0;
}

/* A moved level is a new regime (ReferenceBocdV._holds): a strict majority of the
 * newest min_after iterations moved by min_change as well, the newest hold_newest
 * iterations (at most min_after, none before start) each beyond sqrt(before *
 * after) on the side of `after`, and fewer than min_after or than max_visited of
 * the old level's iterations old[0:n_old] within half of min_change of `after`. */
static int
holds(Kernel *k, int64_t t, double before, double after, int64_t start,
      const double *old, Py_ssize_t n_old)
{
    double half = 0.5 * k->min_change;
    /* A strict majority of the newest min_after iterations moved too. */
    int64_t span = k->min_after < t - start + 1 ? k->min_after : t - start + 1;
    Py_ssize_t r = window_copy(k, t - span + 1, t + 1);
    double low, high;
    middles(k->scratch, r, &low, &high);
    if (after > before ? low < before * (1.0 + k->min_change)
                       : high > before * (1.0 - k->min_change))
        return 0;
    int64_t count = k->hold_newest;
    if (k->min_after < count)
        count = k->min_after;
    if (t - start + 1 < count)
        count = t - start + 1;
    Py_ssize_t m;
    const double *newest = values_window(k, t - count + 1, t + 1, &m);
    double middle = sqrt(before * after);
    if (after > before) {
        for (Py_ssize_t i = 0; i < m; i++)
            if (!(newest[i] >= middle))
                return 0;
    } else {
        for (Py_ssize_t i = 0; i < m; i++)
            if (!(newest[i] <= middle))
                return 0;
    }
    double lo = after / (1.0 + half), hi = after * (1.0 + half);
    Py_ssize_t visited = 0;
    for (Py_ssize_t i = 0; i < n_old; i++)
        if (old[i] >= lo && old[i] <= hi)
            visited++;
    return visited < k->min_after || (double)visited < k->max_visited * (double)n_old;
}

/* A new regime from `start` on (ReferenceBocdV._rebaseline). */
static void
rebaseline(Kernel *k, int64_t start)
{
    k->has_pending = k->has_suspicion = 0;
    k->regime_start = start;
    if (start > k->last_candidate)
        k->last_candidate = start;
}

static int
accept(Kernel *k, int64_t start, int64_t t, double before, double after, Change *out)
{
    rebaseline(k, start);
    out->index = start;
    out->detected_at = t;
    out->before = before;
    out->after = after;
    return 1;
}

static int
check_creep(Kernel *k, int64_t t, Change *out)
{
    if (t % k->creep_every)
        return 0;
    double since = 0.0;
    {
        Py_ssize_t n = 0;
        for (Py_ssize_t i = 0; i < k->size; i++)
            if (k->starts[i] >= k->regime_start + 1)
                k->scratch[n++] = k->p[i];
        since = np_sum(k->scratch, n);
    }
    if (since < k->threshold)
        return 0;
    int64_t reference_end = t - k->before_window + 1;
    if (reference_end - k->regime_start < k->min_after)
        return 0;
    Py_ssize_t m = window_copy(k, t - k->creep_window + 1, t + 1);
    if (m < k->creep_window)
        return 0;
    double low, high;
    middles(k->scratch, m, &low, &high);
    int64_t start;
    int64_t first = k->regime_start + 1 > reference_end ? k->regime_start + 1 : reference_end;
    if (!most_likely_since(k, first, &start) || t - start + 1 < k->min_after)
        return 0;
    int64_t ref_start = reference_end - k->before_window;
    if (k->regime_start > ref_start)
        ref_start = k->regime_start;
    Py_ssize_t n = window_copy(k, ref_start, reference_end);
    if (n == 0)
        return 0; /* cannot happen: the buffer keeps 2 before_window + ... values */
    double before = median(k->scratch, n), after;
    if (!moved(before, low, high, k->min_change, &after))
        return 0;
    const double *old = values_window(k, ref_start, reference_end, &n);
    if (!holds(k, t, before, after, start, old, n))
        return 0;
    return accept(k, start, t, before, after, out);
}

/* One iteration time x (> 0, finite). Returns 1 with *out set for an accepted change
 * point, 0 for none, -1 with an exception set. */
static int
step(Kernel *k, double x, Change *out)
{
    if (posterior_update(k, log(x)) < 0)
        return -1;
    values_append(k, x);
    int64_t t = k->t;
    if (k->has_suspicion && t - k->suspicion > k->before_window)
        k->has_suspicion = 0;
    int64_t flagged;
    if (flagged_start(k, k->last_candidate, &flagged)) {
        k->last_candidate = flagged;
        /* BOCD sometimes re-places an old change long after the fact. */
        if (t - flagged + 1 <= k->max_pending) {
            k->pending = flagged;
            k->has_pending = 1;
        }
    }
    if (!k->has_pending)
        return check_creep(k, t, out);
    int64_t start = k->pending;
    if (prob_between(k, start - 1, start + 2) < k->keep_prob) {
        k->has_pending = 0;
        return check_creep(k, t, out);
    }
    if (t - start + 1 < k->min_after)
        return 0;
    int64_t reference = start;
    if (k->has_suspicion && k->suspicion < start)
        reference = k->suspicion;
    if (reference - k->regime_start < k->min_before)
        reference = start; /* too few iterations before the suspicion to be a level */
    /* level_ratio (greyhound.analytics.changepoint). */
    int64_t lo = reference - k->before_window;
    if (k->regime_start > lo)
        lo = k->regime_start;
    int64_t hi = reference;
    Py_ssize_t n = window_copy(k, lo, hi);
    if (n == 0) {
        lo = reference - 1;
        n = window_copy(k, lo, hi);
    }
    if (n == 0) {
        PyErr_Format(PyExc_ValueError,
                     "no values kept before index %lld; the buffer is too short",
                     (long long)reference);
        return -1;
    }
    double before = median(k->scratch, n);
    Py_ssize_t m = window_copy(k, start, t + 1);
    double low, high, after;
    middles(k->scratch, m, &low, &high);
    if (moved(before, low, high, k->min_change, &after)) {
        const double *old = values_window(k, lo, hi, &n);
        if (holds(k, t, before, after, start, old, n)) {
            if (reference - k->regime_start < k->min_before) {
                /* The old level rests on too few iterations to be a baseline. */
                rebaseline(k, start);
                return 0;
            }
            return accept(k, start, t, before, after, out);
        }
    }
    if (!k->has_suspicion) {
        k->suspicion = start;
        k->has_suspicion = 1;
    }
    if (t - start + 1 >= k->max_pending)
        k->has_pending = 0;
    return 0;
}

static PyObject *
change_tuple(const Change *c)
{
    return Py_BuildValue("(LLdd)", (long long)c->index, (long long)c->detected_at,
                         c->before, c->after);
}

/* ---- Python type ------------------------------------------------------------- */

static void
Kernel_dealloc(Kernel *k)
{
    Py_XDECREF(k->lg_func);
    PyMem_Free(k->lg);
    PyMem_Free(k->starts);
    PyMem_Free(k->kappa); /* kappa holds all float arrays of the posterior */
    PyMem_Free(k->diffs);
    PyMem_Free(k->vbuf);
    PyMem_Free(k->scratch);
    PyMem_Free(k->ta);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

/* Kernel's keyword arguments that are not stored as parsed: the verification counts
 * (parsed as long long, kept as int64_t), the buffer's capacity and the table maker. */
typedef struct {
    long long min_after, max_pending, before_window, creep_window, creep_every;
    long long hold_newest, min_before, values_capacity;
    PyObject *lg_func; /* borrowed */
} KernelArgs;

static int
parse_args(Kernel *k, PyObject *args, PyObject *kw, KernelArgs *a)
{
    static char *names[] = {
        "log_h", "log_1mh", "log_eps", "log_1m_eps", "logpred0_base", "prune_factor",
        "kappa_first", "alpha_first", "mad_per_sigma",
        "alpha0", "noise_default", "noise_floor", "clip", "threshold",
        "max_hypotheses", "noise_window", "noise_min_samples",
        "min_change", "keep_prob", "min_after", "max_pending", "before_window",
        "creep_window", "creep_every", "hold_newest", "min_before", "max_visited",
        "values_capacity", "lg_table", "exact_math", NULL,
    };
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "ddddddddddddddnnnddLLLLLLLdLO|p:Kernel", names, &k->log_h,
            &k->log_1mh, &k->log_eps, &k->log_1m_eps, &k->logpred0_base, &k->prune_factor,
            &k->kappa_first, &k->alpha_first, &k->mad_per_sigma, &k->alpha0,
            &k->noise_default, &k->noise_floor, &k->clip, &k->threshold, &k->max_hyp,
            &k->noise_window, &k->noise_min_samples, &k->min_change, &k->keep_prob,
            &a->min_after, &a->max_pending, &a->before_window, &a->creep_window,
            &a->creep_every, &a->hold_newest, &a->min_before, &k->max_visited,
            &a->values_capacity, &a->lg_func, &k->exact_math))
        return -1;
    return 0;
}

static int
check_args(const Kernel *k, const KernelArgs *a)
{
    if (k->max_hyp < 1 || k->noise_window < 1 || k->noise_min_samples < 1
        || a->min_after < 1 || a->max_pending < a->min_after || a->before_window < 1
        || a->creep_window < 1 || a->creep_every < 1 || a->hold_newest < 1
        || a->min_before < 1 || a->values_capacity < 1
        || !(k->max_visited > 0.0 && k->max_visited <= 1.0)
        || !PyCallable_Check(a->lg_func)) {
        PyErr_SetString(PyExc_ValueError,
                        "greyhound: bocdv kernel: counts must be >= 1, max_visited in (0, 1] "
                        "and lg_table callable");
        return -1;
    }
    return 0;
}

static void
store_args(Kernel *k, const KernelArgs *a)
{
    k->min_after = a->min_after;
    k->max_pending = a->max_pending;
    k->before_window = a->before_window;
    k->creep_window = a->creep_window;
    k->creep_every = a->creep_every;
    k->hold_newest = a->hold_newest;
    k->min_before = a->min_before;
    k->vcap = a->values_capacity;
    Py_INCREF(a->lg_func);
    k->lg_func = a->lg_func;
}

/* The posterior's arrays (capacity max_hyp + 1), the jitter ring, the recent values
 * (twice vcap) and the scratch; freed by Kernel_dealloc, also after a failure. */
static int
allocate(Kernel *k)
{
    Py_ssize_t cap = k->max_hyp + 1;
    k->scratch_len = cap > k->vcap ? cap : (Py_ssize_t)k->vcap;
    if (k->noise_window > k->scratch_len)
        k->scratch_len = k->noise_window;
    k->starts = PyMem_Calloc((size_t)cap, sizeof(int64_t));
    k->kappa = PyMem_Calloc((size_t)cap * 6, sizeof(double));
    k->diffs = PyMem_Calloc((size_t)k->noise_window, sizeof(double));
    k->vbuf = PyMem_Calloc((size_t)(2 * k->vcap), sizeof(double));
    k->scratch = PyMem_Calloc((size_t)k->scratch_len, sizeof(double));
    k->ta = PyMem_Calloc((size_t)cap * 5, sizeof(double));
    if (!k->starts || !k->kappa || !k->diffs || !k->vbuf || !k->scratch || !k->ta) {
        PyErr_NoMemory();
        return -1;
    }
    k->mu = k->kappa + cap;
    k->alpha = k->mu + cap;
    k->beta = k->alpha + cap;
    k->logp = k->beta + cap;
    k->p = k->logp + cap;
    k->tb = k->ta + cap;
    k->tc = k->tb + cap;
    k->td = k->tc + cap;
    k->te = k->td + cap;
    return 0;
}

/* exp, log, log1p: libmvec's where the CPU runs them, unless exact_math. */
static void
choose_math(Kernel *k)
{
    k->vexp = exp_libm;
    k->vlog = log_libm;
    k->vlog1p = log1p_libm;
#if GH_HAVE_MVEC
    if (have_mvec && !k->exact_math) {
        k->vexp = exp_mvec;
        k->vlog = log_mvec;
        k->vlog1p = log1p_mvec;
    }
#endif
}

static int
Kernel_init(Kernel *k, PyObject *args, PyObject *kw)
{
    KernelArgs a;
    if (k->starts != NULL) {
        PyErr_SetString(PyExc_TypeError, "greyhound: bocdv kernel: already initialised");
        return -1;
    }
    if (parse_args(k, args, kw, &a) < 0 || check_args(k, &a) < 0)
        return -1;
    store_args(k, &a);
    if (allocate(k) < 0)
        return -1;
    choose_math(k);
    k->t = -1;
    k->sigma = k->noise_default;
    return 0;
}

static int
check_value(double x, Py_ssize_t at, PyObject *obj)
{
    if (x > 0 && isfinite(x))
        return 0;
    if (obj != NULL) {
        PyErr_Format(PyExc_ValueError, "iteration time must be finite and > 0, got %R", obj);
        return -1;
    }
    PyObject *f = PyFloat_FromDouble(x);
    if (f != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "iteration times must be finite and > 0, got %R at %zd", f, at);
        Py_DECREF(f);
    }
    return -1;
}

PyDoc_STRVAR(feed_doc,
             "feed(xs) -> list[(index, detected_at, before, after)]\n\n"
             "Add iteration times (a C-contiguous 1-D float64 buffer, finite and > 0).");

static PyObject *
Kernel_feed(Kernel *k, PyObject *obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    PyObject *out = NULL;
    if (view.ndim != 1 || view.itemsize != 8 || view.format == NULL
        || strchr(view.format, 'd') == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "greyhound: bocdv kernel: feed takes a 1-D float64 buffer");
        goto fail;
    }
    const double *xs = view.buf;
    Py_ssize_t n = view.shape[0];
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_value(xs[i], i, NULL) < 0)
            goto fail;
    out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        Change c;
        int rc = step(k, xs[i], &c);
        if (rc < 0)
            goto fail;
        if (rc) {
            PyObject *item = change_tuple(&c);
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
        }
    }
    PyBuffer_Release(&view);
    return out;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(update_doc,
             "update(x) -> (index, detected_at, before, after) | None\n\n"
             "Add one iteration time (seconds, finite and > 0).");

static PyObject *
Kernel_update(Kernel *k, PyObject *obj)
{
    double x = PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred())
        return NULL;
    if (check_value(x, 0, obj) < 0)
        return NULL;
    Change c;
    int rc = step(k, x, &c);
    if (rc < 0)
        return NULL;
    if (rc)
        return change_tuple(&c);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(posterior_doc,
             "posterior() -> (t, starts, probs, noise_scale)\n\n"
             "The run-length posterior (for tests): starts and probabilities as lists in\n"
             "slot order, as RunLengthPosterior.starts and .probs give them.");

static PyObject *
Kernel_posterior(Kernel *k, PyObject *Py_UNUSED(ignored))
{
    PyObject *starts = PyList_New(k->size), *probs = PyList_New(k->size);
    if (starts == NULL || probs == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < k->size; i++) {
        PyObject *s = PyLong_FromLongLong(k->starts[i]);
        PyObject *p = PyFloat_FromDouble(k->p[i]);
        if (s == NULL || p == NULL) {
            Py_XDECREF(s);
            Py_XDECREF(p);
            goto fail;
        }
        PyList_SET_ITEM(starts, i, s);
        PyList_SET_ITEM(probs, i, p);
    }
    return Py_BuildValue("(LNNd)", (long long)k->t, starts, probs, k->sigma);
fail:
    Py_XDECREF(starts);
    Py_XDECREF(probs);
    return NULL;
}

static PyObject *
Kernel_get_pending(Kernel *k, void *Py_UNUSED(closure))
{
    if (!k->has_pending)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(k->pending);
}

static PyObject *
Kernel_get_count(Kernel *k, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(k->t + 1);
}

static PyObject *
Kernel_get_math(Kernel *k, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(k->vexp == exp_libm ? "libm" : "libmvec-avx2");
}

static PyMethodDef Kernel_methods[] = {
    {"feed", (PyCFunction)Kernel_feed, METH_O, feed_doc},
    {"update", (PyCFunction)Kernel_update, METH_O, update_doc},
    {"posterior", (PyCFunction)Kernel_posterior, METH_NOARGS, posterior_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Kernel_getset[] = {
    {"pending", (getter)Kernel_get_pending, NULL, "start of the pending candidate, or None",
     NULL},
    {"count", (getter)Kernel_get_count, NULL, "iteration times fed so far", NULL},
    {"math", (getter)Kernel_get_math, NULL, "exp/log/log1p in use: libm or libmvec-avx2",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greyhound.analytics._bocdv.Kernel",
    .tp_doc = PyDoc_STR("BOCD+V online state (use greyhound.analytics.verify.BocdV)."),
    .tp_basicsize = sizeof(Kernel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Kernel_init,
    .tp_dealloc = (destructor)Kernel_dealloc,
    .tp_methods = Kernel_methods,
    .tp_getset = Kernel_getset,
};

static struct PyModuleDef bocdv_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "greyhound.analytics._bocdv",
    .m_doc = PyDoc_STR("The BOCD+V online loop in C (see greyhound.analytics.verify)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__bocdv(void)
{
#if GH_HAVE_MVEC
    __builtin_cpu_init();
    have_mvec = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    if (PyType_Ready(&KernelType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&bocdv_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KernelType);
    if (PyModule_AddObject(m, "Kernel", (PyObject *)&KernelType) < 0) {
        Py_DECREF(&KernelType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "VECTOR_MATH", have_mvec ? "libmvec-avx2" : "libm") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
