/* The optimizer update of zps/store/_kernel.c for one element type.
 *
 * Included twice by _kernel.c, with T (float or double), SUF (f32 or f64) and SQRT
 * (sqrtf or sqrt) defined.  Each function updates the rows named by pos in place (or
 * writes them from src's values, when src is not NULL),
 * with the arithmetic of zps/optim.py's numpy version in the same order and in T
 * (numpy turns the hyperparameters, Python floats, into T before each operation; the
 * kernel does too), so each element gets bit for bit the same value.
 */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* The gradient after clipping to [lo, hi] (infinite bounds without clipping: then the
 * same value) and L2 decay (zps.optim._effective_grad; with wd 0 numpy adds nothing,
 * not even 0.0, which would turn -0.0 into 0.0). */
static inline T CAT(effective, SUF)(T g, T p, T lo, T hi, int has_wd, T wd)
{
    g = g < lo ? lo : g;
    g = g > hi ? hi : g;
    if (has_wd)
        g = g + wd * p;
    return g;
}

/* Prefetch the bytes [p, p + len) (every cache line of a row), for writing.  Only the
 * first PREFETCH_MAX bytes of a longer row (a dense chunk is one row of megabytes): the
 * hardware's own prefetcher follows a long sequential run. */
#ifndef PREFETCH_MAX
#define PREFETCH_MAX 4096
#endif
static inline void CAT(prefetch_row, SUF)(const T *p, Py_ssize_t len)
{
    const char *c = (const char *)p;
    if (len > PREFETCH_MAX)
        len = PREFETCH_MAX;
    for (Py_ssize_t b = 0; b < len; b += 64)
        __builtin_prefetch(c + b, 1);
}

/* Adam's bias corrections come from tables of 1 - beta**t by step t (bc1, bc2, of
 * bclen entries, computed by numpy as zps.optim.Adam does).  Saturated tables end where
 * both powers are below an eighth of the dtype's epsilon: from there on 1 - beta**t
 * rounds to exactly 1 for every t, whole or not, so later steps use the last entry.
 * Returns 0 if every row's next step is covered, else the table length needed
 * (> bclen), or STEPS where a step is not a small whole number (the caller then uses
 * the numpy version). */
static Py_ssize_t CAT(adam_steps, SUF)(Py_ssize_t n, const int64_t *pos, const T *step,
                                       Py_ssize_t bclen, int saturated)
{
    Py_ssize_t need = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        T t = step[pos[i]] + (T)1;
        if (!(t >= (T)1))
            return STEPS; /* NaN, zero or negative */
        if (t >= (T)bclen) {
            if (saturated)
                continue;
            if (t >= (T)MAX_STEP || t != (T)(int64_t)t)
                return STEPS;
            if ((Py_ssize_t)t + 1 > need)
                need = (Py_ssize_t)t + 1;
        } else if (t != (T)(int64_t)t) {
            return STEPS;
        }
    }
    return need;
}

UPDATE_CLONES static void CAT(update, SUF)(const Opt *o, Py_ssize_t n, Py_ssize_t dim,
                                           const int64_t *pos, const T *grads, T *rows,
                                           const T *src, T *s0, T *s1, T *s2, const T *bc1, const T *bc2,
                                           Py_ssize_t bclen)
{
    /* Row bytes of each array: rows and the state arrays of width dim; Adam's step
     * column has width 1. */
    Py_ssize_t rb = dim * (Py_ssize_t)sizeof(T);
    int nstate = o->kind == SGD ? 0 : o->kind == MOMENTUM || o->kind == ADAGRAD ? 1 : 2;
    for (Py_ssize_t i = 0; i < n && i < ROWS_AHEAD; i++) {
        Py_ssize_t r = (Py_ssize_t)pos[i] * dim;
        CAT(prefetch_row, SUF)(rows + r, rb);
        if (nstate > 0)
            CAT(prefetch_row, SUF)(s0 + r, rb);
        if (nstate > 1)
            CAT(prefetch_row, SUF)(s1 + r, rb);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + ROWS_AHEAD < n) {
            Py_ssize_t r = (Py_ssize_t)pos[i + ROWS_AHEAD] * dim;
            CAT(prefetch_row, SUF)(rows + r, rb);
            if (nstate > 0)
                CAT(prefetch_row, SUF)(s0 + r, rb);
            if (nstate > 1)
                CAT(prefetch_row, SUF)(s1 + r, rb);
            if (o->kind == ADAM)
                __builtin_prefetch(s2 + pos[i + ROWS_AHEAD], 1);
        }
        Py_ssize_t r = (Py_ssize_t)pos[i] * dim;
        T *p = rows + r;
        const T *was = src ? src + r : p; /* the values before */
        const T *g = grads + i * dim;
        T lo = o->has_clip ? (T)(-o->clip) : (T)-INFINITY;
        T hi = o->has_clip ? (T)o->clip : (T)INFINITY;
        T wd = (T)o->wd;
        int has_wd = o->has_wd;
        switch (o->kind) {
        case SGD: {
            T lr = (T)o->h[0];
            for (Py_ssize_t j = 0; j < dim; j++) {
                T e = CAT(effective, SUF)(g[j], was[j], lo, hi, has_wd, wd);
                p[j] = was[j] - lr * e;
            }
            break;
        }
        case MOMENTUM: {
            T lr = (T)o->h[0], mom = (T)o->h[1];
            T *v = s0 + r;
            for (Py_ssize_t j = 0; j < dim; j++) {
                T e = CAT(effective, SUF)(g[j], was[j], lo, hi, has_wd, wd);
                T vj = v[j] * mom;
                vj = vj + e;
                v[j] = vj;
                if (o->flag)
                    p[j] = was[j] - lr * (e + mom * vj);
                else
                    p[j] = was[j] - lr * vj;
            }
            break;
        }
        case ADAGRAD: {
            T lr = (T)o->h[0], eps = (T)o->h[1];
            T *a = s0 + r;
            for (Py_ssize_t j = 0; j < dim; j++) {
                T e = CAT(effective, SUF)(g[j], was[j], lo, hi, has_wd, wd);
                T aj = a[j] + e * e;
                a[j] = aj;
                T t = SQRT(aj) + eps;
                T u = e * lr;
                p[j] = was[j] - u / t;
            }
            break;
        }
        case ADAM: {
            T lr = (T)o->h[0], b1 = (T)o->h[1], b2 = (T)o->h[2], eps = (T)o->h[3];
            T c1 = (T)(1.0 - o->h[1]), c2 = (T)(1.0 - o->h[2]);
            T *m = s0 + r, *v = s1 + r;
            T t = s2[pos[i]] + (T)1;
            s2[pos[i]] = t;
            /* checked by adam_steps: whole and in the tables, or past saturated ones */
            Py_ssize_t k = t < (T)bclen ? (Py_ssize_t)t : bclen - 1;
            T d1 = bc1[k], d2 = bc2[k];
            for (Py_ssize_t j = 0; j < dim; j++) {
                T e = CAT(effective, SUF)(g[j], was[j], lo, hi, has_wd, wd);
                T mj = m[j] * b1;
                mj = mj + c1 * e;
                m[j] = mj;
                T vj = v[j] * b2;
                vj = vj + c2 * (e * e);
                v[j] = vj;
                p[j] = was[j] - (lr * (mj / d1)) / (SQRT(vj / d2) + eps);
            }
            break;
        }
        case FTRL: {
            T alpha = (T)o->h[0], beta = (T)o->h[1], l1 = (T)o->h[2], l2 = (T)o->h[3];
            T *z = s0 + r, *nn = s1 + r;
            for (Py_ssize_t j = 0; j < dim; j++) {
                T e = CAT(effective, SUF)(g[j], was[j], lo, hi, 0, wd); /* no L2 decay */
                T g2 = e * e;
                T nj = nn[j];
                T sigma = (SQRT(nj + g2) - SQRT(nj)) / alpha;
                T zj = z[j] + (e - sigma * was[j]);
                /* A NaN is stored as the one quiet NaN (NAN), whatever sign and payload
                 * the arithmetic gave it, as zps.optim's numpy version stores it. */
                zj = zj != zj ? (T)NAN : zj;
                z[j] = zj;
                nj = nj + g2;
                nn[j] = nj;
                T denom = (beta + SQRT(nj)) / alpha + l2;
                /* np.sign; both sides of the np.where computed, as numpy does (no
                 * branch: the loop vectorizes) */
                T sign = (zj > 0 ? (T)1 : (T)0) - (zj < 0 ? (T)1 : (T)0);
                T shrunk = zj - sign * l1;
                T q = -shrunk / denom;
                T az = zj < 0 ? -zj : zj;
                T pj = az <= l1 ? (T)0 : q;
                p[j] = pj != pj ? (T)NAN : pj;
            }
            break;
        }
        }
    }
}

#undef CAT
#undef CAT_
