/* An embedding table's sparse hot path (zps.store.tables.EmbeddingTable) in C.
 *
 * - pull(slots, keys, rows, out, pos): for each key, probe the id index (the slots of
 *   zps/store/index.py) and copy its row into out; pos gets each key's position, or
 *   -1 where absent (that row of out is left for the caller to fill).  Returns how
 *   many keys were absent.  Home slots are prefetched AHEAD keys ahead; the rows are
 *   copied with a memcpy of constant size for the common row sizes, each row's lines
 *   prefetched COPY_AHEAD rows ahead (a pull of 2,101 Zipf rows of 128 bytes from a
 *   table of 1M: 30-35 us from 51-60 without).
 * - gather(rows, pos, out): out[i] = rows[pos[i]] (positions known, e.g. remembered
 *   from the pull before a push).
 * - push(opt, slots, keys, pos, probe, marks, gen, grads, rows, states, bc1, bc2,
 *   apply): a push of distinct, existing rows in one call.  First, per key: the probe
 *   (if probe; else pos holds the positions) and a duplicate check (if marks is not
 *   None: marks[pos] is set to gen, and a position found already marked is a
 *   duplicate).  Then, if apply, the optimizer updates each row and its state in
 *   place (each row's lines of every array prefetched ROWS_AHEAD rows ahead): no
 *   gathered copies, no temporaries.  Returns OK (0), or, with nothing
 *   changed, MISSING (an id is absent), DUPLICATE, STEPS (an Adam step count is not a
 *   small whole number) or the length Adam's bias-correction tables must have.
 *
 * Rows and optimizer state stay in the table's separate arrays (rows, then the state
 * arrays of zps/optim.py in their order); the update prefetches each row's lines of
 * every array ahead.  float32 and float64 are supported; the arithmetic is that of
 * zps/optim.py's numpy version, operation by operation in the table's dtype, so the
 * results are bit for bit the same (compiled without floating-point contraction,
 * see setup.py).  Optional: without a compiler zps uses the numpy version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EMPTY INT64_MIN
#define AHEAD 16
#define ROWS_AHEAD 16
#define COPY_AHEAD 32
/* Tables of Adam's bias corrections grow up to this many steps; rows with more steps
 * are left to numpy unless the tables saturated earlier (see adam_steps). */
#define MAX_STEP (1 << 21)

enum { SGD = 0, MOMENTUM = 1, ADAGRAD = 2, ADAM = 3, FTRL = 4 };
enum { OK = 0, MISSING = -1, DUPLICATE = -2, STEPS = -3 };
#define SLOTS_MSG "slots must hold a power of two of (key, position) pairs"

typedef struct {
    /* flag: Momentum's nesterov; Adam's tables of bias corrections are saturated */
    int kind, has_clip, has_wd, flag;
    double clip, wd, h[4];
} Opt;

static inline uint64_t mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The update loops are compiled for SSE2 (any x86-64), AVX2 and AVX-512 where GCC can
 * pick one at load time: numpy's own loops use the widest the machine has.  Every
 * variant rounds the same (IEEE operations, no contraction into fused multiply-adds). */
#if defined(UPDATE_CLONES)
/* as the build says */
#elif defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define UPDATE_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define UPDATE_CLONES
#endif

#define T float
#define SUF f32
#define SQRT sqrtf
#include "_kernel_update.h"
#undef T
#undef SUF
#undef SQRT

#define T double
#define SUF f64
#define SQRT sqrt
#include "_kernel_update.h"
#undef T
#undef SUF
#undef SQRT

/* -- buffers ---------------------------------------------------------------------- */

/* What a buffer must hold: 'q' int64, 'I' uint32, 'f' float32 or float64 (any of the
 * two: the caller compares item sizes), 'x' anything (rows moved as bytes). */
static int format_ok(const Py_buffer *v, char kind)
{
    const char *f = v->format;
    if (kind == 'x')
        return 1;
    if (f == NULL)
        return 0;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    switch (kind) {
    case 'q':
        return v->itemsize == 8 && (f[0] == 'q' || f[0] == 'l');
    case 'I':
        return v->itemsize == 4 && f[0] == 'I';
    case 'f':
        return (v->itemsize == 4 && f[0] == 'f') || (v->itemsize == 8 && f[0] == 'd');
    }
    return 0;
}

/* A C-contiguous buffer of ndim dimensions (0: any) of the given kind. */
static int get_buf(PyObject *obj, Py_buffer *view, int writable, char kind, int ndim,
                   const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (!format_ok(view, kind) || (ndim && view->ndim != ndim)) {
        PyErr_Format(PyExc_TypeError, "%s: wrong dtype or number of dimensions", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#define MAX_BUFS 12
typedef struct {
    Py_buffer v[MAX_BUFS];
    int n;
} Held;

static Py_buffer *hold(Held *h, PyObject *obj, int writable, char kind, int ndim,
                       const char *what)
{
    if (h->n >= MAX_BUFS) {
        PyErr_SetString(PyExc_RuntimeError, "too many buffers");
        return NULL;
    }
    if (get_buf(obj, &h->v[h->n], writable, kind, ndim, what) < 0)
        return NULL;
    return &h->v[h->n++];
}

static void release(Held *h)
{
    for (int i = 0; i < h->n; i++)
        PyBuffer_Release(&h->v[i]);
    h->n = 0;
}

static PyObject *fail(Held *h, PyObject *exc, const char *msg)
{
    if (exc != NULL)
        PyErr_SetString(exc, msg);
    release(h);
    return NULL;
}

/* -- the probe ---------------------------------------------------------------------- */

static inline int64_t probe(const int64_t *s, uint64_t mask, int64_t key)
{
    uint64_t slot = mix64((uint64_t)key) & mask;
    /* The load factor stays <= 3/4, so a free slot ends every probe sequence; a free
     * slot's position is -1, "absent" (EMPTY itself is never stored). */
    for (;;) {
        int64_t found = s[2 * slot];
        if (found == key || found == EMPTY)
            return s[2 * slot + 1];
        slot = (slot + 1) & mask;
    }
}

static int slots_ok(const Py_buffer *slots, Py_ssize_t *cap)
{
    *cap = slots->len / 16;
    if (*cap < 1 || (*cap & (*cap - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, SLOTS_MSG);
        return 0;
    }
    return 1;
}

/* -- pull and gather ---------------------------------------------------------------- */

/* dst[i] = src[pos[i]] for rows of w bytes, skipping negative positions.  The common
 * widths get a memcpy of constant size (inlined: the loads of many rows are in flight
 * at once). */
#define COPY_ROWS(W)                                                                      \
    for (Py_ssize_t i = 0; i < n; i++) {                                                 \
        if (i + COPY_AHEAD < n && pos[i + COPY_AHEAD] >= 0) {                            \
            const char *r = src + pos[i + COPY_AHEAD] * (W);                             \
            for (Py_ssize_t b = 0; b < (W); b += 64)                                     \
                __builtin_prefetch(r + b);                                               \
            __builtin_prefetch(r + (W) - 1); /* a row across a line boundary */          \
        }                                                                                \
        if (pos[i] >= 0)                                                                 \
            memcpy(dst + i * (W), src + pos[i] * (W), (size_t)(W));                      \
    }

static void copy_rows(char *dst, const char *src, const int64_t *pos, Py_ssize_t n,
                      Py_ssize_t w)
{
    switch (w) {
    case 32: COPY_ROWS(32) break;
    case 64: COPY_ROWS(64) break;
    case 128: COPY_ROWS(128) break;
    case 256: COPY_ROWS(256) break;
    case 512: COPY_ROWS(512) break;
    default: COPY_ROWS(w) break;
    }
}

static PyObject *pull(PyObject *self, PyObject *args)
{
    PyObject *o_slots, *o_keys, *o_rows, *o_out, *o_pos;
    Held h = {.n = 0};
    if (!PyArg_ParseTuple(args, "OOOOO:pull", &o_slots, &o_keys, &o_rows, &o_out, &o_pos))
        return NULL;
    Py_buffer *slots = hold(&h, o_slots, 0, 'q', 0, "slots");
    Py_buffer *keys = slots ? hold(&h, o_keys, 0, 'q', 1, "keys") : NULL;
    Py_buffer *rows = keys ? hold(&h, o_rows, 0, 'x', 2, "rows") : NULL;
    Py_buffer *out = rows ? hold(&h, o_out, 1, 'x', 2, "out") : NULL;
    Py_buffer *pos = out ? hold(&h, o_pos, 1, 'q', 1, "pos") : NULL;
    if (pos == NULL)
        return fail(&h, NULL, NULL);
    Py_ssize_t cap, n = keys->shape[0], nrows = rows->shape[0];
    if (!slots_ok(slots, &cap))
        return fail(&h, NULL, NULL);
    Py_ssize_t rb = rows->shape[1] * rows->itemsize;
    if (pos->shape[0] != n || out->shape[0] != n || out->shape[1] * out->itemsize != rb)
        return fail(&h, PyExc_ValueError,
                    "out must have a row per key, of rows' row size; pos a position per key");
    const int64_t *s = (const int64_t *)slots->buf, *k = (const int64_t *)keys->buf;
    const char *src = (const char *)rows->buf;
    char *dst = (char *)out->buf;
    int64_t *p = (int64_t *)pos->buf;
    uint64_t mask = (uint64_t)cap - 1;
    Py_ssize_t missing = 0, bad = 0;

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i]) & mask));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i + AHEAD]) & mask));
        int64_t at = probe(s, mask, k[i]);
        if (at >= nrows) {
            bad = 1;
            at = -1;
        }
        missing += at < 0;
        p[i] = at;
    }
    copy_rows(dst, src, p, n, rb);
    Py_END_ALLOW_THREADS

    release(&h);
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "the index names a position beyond the rows");
        return NULL;
    }
    return PyLong_FromSsize_t(missing);
}

static PyObject *gather(PyObject *self, PyObject *args)
{
    PyObject *o_rows, *o_pos, *o_out;
    Held h = {.n = 0};
    if (!PyArg_ParseTuple(args, "OOO:gather", &o_rows, &o_pos, &o_out))
        return NULL;
    Py_buffer *rows = hold(&h, o_rows, 0, 'x', 2, "rows");
    Py_buffer *pos = rows ? hold(&h, o_pos, 0, 'q', 1, "pos") : NULL;
    Py_buffer *out = pos ? hold(&h, o_out, 1, 'x', 2, "out") : NULL;
    if (out == NULL)
        return fail(&h, NULL, NULL);
    Py_ssize_t n = pos->shape[0], nrows = rows->shape[0];
    Py_ssize_t rb = rows->shape[1] * rows->itemsize;
    if (out->shape[0] != n || out->shape[1] * out->itemsize != rb)
        return fail(&h, PyExc_ValueError, "out must have a row per position, of rows' row size");
    const int64_t *p = (const int64_t *)pos->buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] >= nrows)
            return fail(&h, PyExc_IndexError, "position out of range");
    const char *src = (const char *)rows->buf;
    char *dst = (char *)out->buf;

    Py_BEGIN_ALLOW_THREADS
    copy_rows(dst, src, p, n, rb);
    Py_END_ALLOW_THREADS

    release(&h);
    Py_RETURN_NONE;
}

/* -- push ------------------------------------------------------------------------- */

static int parse_opt(PyObject *t, Opt *o)
{
    double clip, wd;
    if (!PyArg_ParseTuple(t, "iddddddi:opt", &o->kind, &clip, &wd, &o->h[0], &o->h[1],
                          &o->h[2], &o->h[3], &o->flag))
        return 0;
    if (o->kind < SGD || o->kind > FTRL) {
        PyErr_SetString(PyExc_ValueError, "unknown optimizer kind");
        return 0;
    }
    o->has_clip = clip > 0;
    o->clip = clip;
    o->has_wd = wd != 0;
    o->wd = wd;
    return 1;
}

static PyObject *push(PyObject *self, PyObject *args)
{
    PyObject *o_opt, *o_slots, *o_keys, *o_pos, *o_marks, *o_grads, *o_rows, *o_states;
    PyObject *o_bc1, *o_bc2, *o_src = Py_None;
    int do_probe, do_apply;
    unsigned int gen;
    Held h = {.n = 0};
    Opt o;
    if (!PyArg_ParseTuple(args, "OOOOpOIOOO!OOp|O:push", &o_opt, &o_slots, &o_keys, &o_pos,
                          &do_probe, &o_marks, &gen, &o_grads, &o_rows, &PyTuple_Type,
                          &o_states, &o_bc1, &o_bc2, &do_apply, &o_src))
        return NULL;
    if (!parse_opt(o_opt, &o))
        return NULL;
    int nstate = o.kind == SGD ? 0 : o.kind == ADAM ? 3 : o.kind == FTRL ? 2 : 1;
    if (PyTuple_GET_SIZE(o_states) != nstate) {
        PyErr_SetString(PyExc_ValueError, "wrong number of state arrays for the optimizer");
        return NULL;
    }
    Py_buffer *pos = hold(&h, o_pos, do_probe, 'q', 1, "pos");
    if (pos == NULL)
        return fail(&h, NULL, NULL);
    Py_ssize_t n = pos->shape[0];
    Py_buffer *slots = NULL, *keys = NULL, *marks = NULL;
    if (do_probe) {
        if ((slots = hold(&h, o_slots, 0, 'q', 0, "slots")) == NULL ||
            (keys = hold(&h, o_keys, 0, 'q', 1, "keys")) == NULL)
            return fail(&h, NULL, NULL);
        if (keys->shape[0] != n)
            return fail(&h, PyExc_ValueError, "pos must have a position per key");
    }
    if (o_marks != Py_None && (marks = hold(&h, o_marks, 1, 'I', 1, "marks")) == NULL)
        return fail(&h, NULL, NULL);
    Py_buffer *rows = hold(&h, o_rows, 1, 'f', 2, "rows");
    Py_buffer *grads = rows ? hold(&h, o_grads, 0, 'f', 2, "grads") : NULL;
    if (grads == NULL)
        return fail(&h, NULL, NULL);
    Py_ssize_t nrows = rows->shape[0], dim = rows->shape[1], isz = rows->itemsize;
    if (grads->itemsize != isz || grads->shape[0] != n || grads->shape[1] != dim)
        return fail(&h, PyExc_ValueError, "grads must be (len(pos), dim) in the rows' dtype");
    if (marks != NULL && marks->shape[0] < nrows)
        return fail(&h, PyExc_ValueError, "marks must have an entry per row");
    /* src: the rows' values before the update, when they are not rows itself (an
     * update written to a new array: a dense chunk lent to a reader). */
    Py_buffer *src = NULL;
    if (o_src != Py_None) {
        if ((src = hold(&h, o_src, 0, 'f', 2, "src")) == NULL)
            return fail(&h, NULL, NULL);
        if (src->itemsize != isz || src->shape[0] != nrows || src->shape[1] != dim)
            return fail(&h, PyExc_ValueError, "src must be shaped as rows, in their dtype");
    }
    void *st[3] = {NULL, NULL, NULL};
    for (int i = 0; i < nstate; i++) {
        Py_buffer *b = hold(&h, PyTuple_GET_ITEM(o_states, i), 1, 'f', 2, "state");
        if (b == NULL)
            return fail(&h, NULL, NULL);
        Py_ssize_t w = (o.kind == ADAM && i == 2) ? 1 : dim;
        if (b->itemsize != isz || b->shape[0] < nrows || b->shape[1] != w)
            return fail(&h, PyExc_ValueError, "a state array has the wrong shape or dtype");
        st[i] = b->buf;
    }
    Py_buffer *bc1 = NULL, *bc2 = NULL;
    if (o.kind == ADAM) {
        if ((bc1 = hold(&h, o_bc1, 0, 'f', 1, "bc1")) == NULL ||
            (bc2 = hold(&h, o_bc2, 0, 'f', 1, "bc2")) == NULL)
            return fail(&h, NULL, NULL);
        if (bc1->itemsize != isz || bc2->itemsize != isz || bc1->shape[0] != bc2->shape[0] ||
            bc1->shape[0] < 2)
            return fail(&h, PyExc_ValueError, "bc1 and bc2 must be alike, in the rows' dtype");
    }

    int64_t *p = (int64_t *)pos->buf;
    uint32_t *mk = marks ? (uint32_t *)marks->buf : NULL;
    Py_ssize_t status = OK;
    int bad = 0;

    Py_BEGIN_ALLOW_THREADS
    /* Pass one: positions and the duplicate check; nothing is written but pos and
     * marks, so any refusal leaves the table as it was. */
    if (do_probe) {
        const int64_t *s = (const int64_t *)slots->buf, *k = (const int64_t *)keys->buf;
        uint64_t mask = (uint64_t)(slots->len / 16) - 1;
        if (mask == (uint64_t)-1 || (mask & (mask + 1)) != 0) {
            bad = 2;
        } else {
            for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
                __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i]) & mask));
            for (Py_ssize_t i = 0; i < n; i++) {
                if (i + AHEAD < n)
                    __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i + AHEAD]) & mask));
                int64_t at = probe(s, mask, k[i]);
                p[i] = at;
                if (at < 0) {
                    status = MISSING;
                    break;
                }
                if (mk != NULL)
                    __builtin_prefetch(mk + at, 1);
            }
        }
    }
    for (Py_ssize_t i = 0; status == OK && !bad && i < n; i++)
        if (p[i] < 0 || p[i] >= nrows)
            bad = 1;
    if (status == OK && !bad && mk != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (mk[p[i]] == gen) {
                status = DUPLICATE;
                break;
            }
            mk[p[i]] = gen;
        }
    }
    if (status == OK && !bad && o.kind == ADAM && do_apply) {
        status = isz == 4 ? adam_steps_f32(n, p, (const float *)st[2], bc1->shape[0], o.flag)
                          : adam_steps_f64(n, p, (const double *)st[2], bc1->shape[0], o.flag);
    }
    /* Pass two: the update, in place. */
    if (status == OK && !bad && do_apply) {
        if (isz == 4)
            update_f32(&o, n, dim, p, (const float *)grads->buf, (float *)rows->buf,
                       src ? (const float *)src->buf : NULL, (float *)st[0], (float *)st[1], (float *)st[2],
                       bc1 ? (const float *)bc1->buf : NULL,
                       bc2 ? (const float *)bc2->buf : NULL, bc1 ? bc1->shape[0] : 0);
        else
            update_f64(&o, n, dim, p, (const double *)grads->buf, (double *)rows->buf,
                       src ? (const double *)src->buf : NULL, (double *)st[0], (double *)st[1], (double *)st[2],
                       bc1 ? (const double *)bc1->buf : NULL,
                       bc2 ? (const double *)bc2->buf : NULL, bc1 ? bc1->shape[0] : 0);
    }
    Py_END_ALLOW_THREADS

    release(&h);
    if (bad == 2) {
        PyErr_SetString(PyExc_ValueError, SLOTS_MSG);
        return NULL;
    }
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "position out of range");
        return NULL;
    }
    return PyLong_FromSsize_t(status);
}

static PyMethodDef methods[] = {
    {"pull", pull, METH_VARARGS,
     "pull(slots, keys, rows, out, pos) -> absent: probe each key and copy its row."},
    {"gather", gather, METH_VARARGS, "gather(rows, pos, out): out[i] = rows[pos[i]]."},
    {"push", push, METH_VARARGS,
     "push(opt, slots, keys, pos, probe, marks, gen, grads, rows, states, bc1, bc2, apply"
     "[, src]) -> status: probe, check and update distinct existing rows in place (from "
     "src's values, when given)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps.store._kernel",
    "An embedding table's pull and push, compiled (see zps/store/tables.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernel(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    static const struct {
        const char *name;
        int value;
    } constants[] = {
        {"OK", OK},   {"MISSING", MISSING},   {"DUPLICATE", DUPLICATE}, {"STEPS", STEPS},
        {"SGD", SGD}, {"MOMENTUM", MOMENTUM}, {"ADAGRAD", ADAGRAD},     {"ADAM", ADAM},
        {"FTRL", FTRL},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
