/* The client's row routing in one pass each (see zps/core/rows.py): split ids by
 * partition, gather rows by position, scatter rows to positions.
 *
 * split(ids, slot_map, pos_out, ids_out, counts_out)
 *     partition of id i = slot_map[mix64(id) % n_slots] (mix64 is the SplitMix64
 *     finaliser of zps.core.hashing; a power-of-two slot count uses a mask).  Writes
 *     the positions 0..n-1 grouped by partition, ascending within each (pos_out), the
 *     ids in the same order (ids_out) and each partition's count (counts_out, one
 *     item per partition).  ids, pos_out, ids_out, counts_out: int64; slot_map: int32.
 * gather(src, pos, out)      out[i] = src[pos[i]]   (rows of src.shape[1] items)
 * scatter(dst, pos, src)     dst[pos[i]] = src[i]
 *     Rows are copied as bytes; the row width is the size of out (gather) or src
 *     (scatter) divided by len(pos).  Every position is checked against the row count.
 * copy_finite(dst, src, itemsize) -> bool
 *     dst[:] = src (bytes, the same length), and whether every float of src is finite
 *     (itemsize 4: float32, 8: float64), checked as it is copied: the check costs no
 *     pass of its own over memory.  The GIL is released for the copy (megabytes).
 * fence()
 *     A full memory barrier (loads and stores on either side stay on their side), for
 *     the tokens of shared-memory regions (zps/shm.py) on CPUs that reorder them.
 *
 * The GIL is held: each call is tens of microseconds, shorter than a thread switch.
 * Optional: without a compiler zps uses the numpy versions (same results).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static int is_format(const Py_buffer *v, char a, char b)
{
    const char *f = v->format;
    if (f == NULL)
        return 0;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return (f[0] == a || f[0] == b) && f[1] == '\0';
}

/* A C-contiguous buffer; itemsize 8 and an integer format if int64 is asked for
 * (kind 'q'), 4 and an integer format for int32 (kind 'i'), any layout for bytes (0). */
static int get_buf(PyObject *obj, Py_buffer *view, int writable, char kind, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    int ok = 1;
    if (kind == 'q')
        ok = view->itemsize == 8 && is_format(view, 'l', 'q');
    else if (kind == 'i')
        ok = view->itemsize == 4 && is_format(view, 'i', 'i');
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous buffer of %s", what,
                     kind == 'q' ? "int64" : "int32");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *split(PyObject *self, PyObject *args)
{
    PyObject *o_ids, *o_map, *o_pos, *o_out, *o_counts;
    Py_buffer ids, map, pos, out, counts;
    if (!PyArg_ParseTuple(args, "OOOOO:split", &o_ids, &o_map, &o_pos, &o_out, &o_counts))
        return NULL;
    if (get_buf(o_ids, &ids, 0, 'q', "ids") < 0)
        return NULL;
    if (get_buf(o_map, &map, 0, 'i', "slot_map") < 0)
        goto e1;
    if (get_buf(o_pos, &pos, 1, 'q', "pos_out") < 0)
        goto e2;
    if (get_buf(o_out, &out, 1, 'q', "ids_out") < 0)
        goto e3;
    if (get_buf(o_counts, &counts, 1, 'q', "counts_out") < 0)
        goto e4;

    Py_ssize_t n = ids.len / 8, n_slots = map.len / 4, n_parts = counts.len / 8;
    const int64_t *k = (const int64_t *)ids.buf;
    const int32_t *sm = (const int32_t *)map.buf;
    int64_t *p_out = (int64_t *)pos.buf, *i_out = (int64_t *)out.buf;
    int64_t *cnt = (int64_t *)counts.buf;
    int32_t *owner = NULL;
    int64_t *next = NULL;
    if (pos.len != ids.len || out.len != ids.len || n_slots < 1 || n_parts < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "pos_out and ids_out must hold as many items as ids, slot_map and "
                        "counts_out at least one");
        goto e5;
    }
    owner = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    next = PyMem_Malloc((size_t)n_parts * sizeof(int64_t));
    if (owner == NULL || next == NULL) {
        PyErr_NoMemory();
        goto e5;
    }
    memset(cnt, 0, (size_t)n_parts * sizeof(int64_t));
    uint64_t slots = (uint64_t)n_slots;
    if ((slots & (slots - 1)) == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            owner[i] = sm[mix64((uint64_t)k[i]) & (slots - 1)];
    else
        for (Py_ssize_t i = 0; i < n; i++)
            owner[i] = sm[mix64((uint64_t)k[i]) % slots];
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t part = owner[i];
        if (part < 0 || part >= n_parts) {
            PyErr_Format(PyExc_ValueError, "slot_map names partition %d of %zd", (int)part,
                         n_parts);
            goto e5;
        }
        cnt[part]++;
    }
    int64_t at = 0;
    for (Py_ssize_t p = 0; p < n_parts; p++) {
        next[p] = at;
        at += cnt[p];
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t o = next[owner[i]]++;
        p_out[o] = i;
        i_out[o] = k[i];
    }
    PyMem_Free(owner);
    PyMem_Free(next);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&out);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&map);
    PyBuffer_Release(&ids);
    Py_RETURN_NONE;

e5:
    PyMem_Free(owner);
    PyMem_Free(next);
    PyBuffer_Release(&counts);
e4:
    PyBuffer_Release(&out);
e3:
    PyBuffer_Release(&pos);
e2:
    PyBuffer_Release(&map);
e1:
    PyBuffer_Release(&ids);
    return NULL;
}

/* Copy rows of a width known at compile time (inlined as vector moves) or not. */
#define COPY_ROWS(W)                                                                  \
    for (Py_ssize_t i = 0; i < m; i++) {                                             \
        memcpy(dst + (size_t)(scatter ? ix[i] : i) * (W),                            \
               src + (size_t)(scatter ? i : ix[i]) * (W), (W));                      \
    }

static inline int copy_rows(char *dst, const char *src, const int64_t *ix, Py_ssize_t m,
                     Py_ssize_t w, int scatter)
{
    switch (w) {
    case 16: COPY_ROWS(16) break;
    case 32: COPY_ROWS(32) break;
    case 64: COPY_ROWS(64) break;
    case 128: COPY_ROWS(128) break;
    case 256: COPY_ROWS(256) break;
    case 512: COPY_ROWS(512) break;
    default: COPY_ROWS(w) break;
    }
    return 0;
}

/* gather (scatter = 0): a = src, b = out; scatter (1): a = dst, b = src.  Rows of a are
 * addressed by position; b holds len(pos) rows in order. */
static PyObject *move(PyObject *args, int scatter)
{
    PyObject *o_a, *o_pos, *o_b;
    Py_buffer a, pos, b;
    if (!PyArg_ParseTuple(args, scatter ? "OOO:scatter" : "OOO:gather", &o_a, &o_pos, &o_b))
        return NULL;
    if (get_buf(o_a, &a, scatter, 0, "the table") < 0)
        return NULL;
    if (get_buf(o_pos, &pos, 0, 'q', "pos") < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    if (get_buf(o_b, &b, !scatter, 0, "the rows") < 0) {
        PyBuffer_Release(&a);
        PyBuffer_Release(&pos);
        return NULL;
    }
    Py_ssize_t m = pos.len / 8, w = 0, rows = 0;
    const int64_t *ix = (const int64_t *)pos.buf;
    if (m > 0) {
        w = b.len / m;
        if (w < 1 || w * m != b.len || a.len % w != 0) {
            PyErr_SetString(PyExc_ValueError, "rows of different widths");
            goto fail;
        }
        /* 2-D arrays: the row width must be their rows' (others are taken as bytes) */
        if ((a.ndim == 2 && a.shape[1] * a.itemsize != w) ||
            (b.ndim == 2 && b.shape[1] * b.itemsize != w)) {
            PyErr_SetString(PyExc_ValueError, "rows of different widths");
            goto fail;
        }
        rows = a.len / w;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (ix[i] < 0 || ix[i] >= rows) {
                PyErr_Format(PyExc_IndexError, "position %lld out of range for %zd rows",
                             (long long)ix[i], rows);
                goto fail;
            }
        }
        if (scatter)
            copy_rows((char *)a.buf, (const char *)b.buf, ix, m, w, 1);
        else
            copy_rows((char *)b.buf, (const char *)a.buf, ix, m, w, 0);
    }
    else if (b.len != 0) {
        PyErr_SetString(PyExc_ValueError, "rows of different widths");
        goto fail;
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&a);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&b);
    return NULL;
}

static PyObject *gather(PyObject *self, PyObject *args) { return move(args, 0); }

static PyObject *scatter(PyObject *self, PyObject *args) { return move(args, 1); }

static PyObject *copy_finite(PyObject *self, PyObject *args)
{
    PyObject *o_dst, *o_src;
    int itemsize;
    if (!PyArg_ParseTuple(args, "OOi:copy_finite", &o_dst, &o_src, &itemsize))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 4 or 8");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(o_dst, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(o_src, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len || src.len % itemsize != 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError,
                        "dst and src must have the same length, a whole number of items");
        return NULL;
    }
    Py_ssize_t len = src.len;
    uint64_t bad = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Each item is loaded once, stored, and checked as loaded: what is checked is what
     * was copied, whatever the source does meanwhile.  An exponent of all ones is an
     * infinity or a NaN: adding one to the exponent field then carries into the sign
     * bit, for no other exponent (ands, adds and ors: the loop vectorizes and runs at
     * the speed of a memcpy). */
    /* The buffers may sit at any byte offset (a shared-memory region starts where the
     * peer says): words are loaded and stored through memcpy, which has no alignment
     * requirement and compiles to plain unaligned moves. */
    const unsigned char *x = (const unsigned char *)src.buf;
    unsigned char *y = (unsigned char *)dst.buf;
    if (itemsize == 4) {
        uint32_t acc = 0;
        for (Py_ssize_t i = 0; i < len / 4; i++) {
            uint32_t v;
            memcpy(&v, x + 4 * i, 4);
            memcpy(y + 4 * i, &v, 4);
            acc |= (v & 0x7f800000u) + 0x00800000u;
        }
        bad = acc >> 31;
    } else {
        uint64_t acc = 0;
        for (Py_ssize_t i = 0; i < len / 8; i++) {
            uint64_t v;
            memcpy(&v, x + 8 * i, 8);
            memcpy(y + 8 * i, &v, 8);
            acc |= (v & 0x7ff0000000000000ull) + 0x0010000000000000ull;
        }
        bad = acc >> 63;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyBool_FromLong(bad == 0);
}

static PyObject *same(PyObject *self, PyObject *args)
{
    /* Whether two buffers hold the same bytes: memcmp stops at the first difference,
     * where numpy's array_equal compares every element (see zps/core/memo.py). */
    PyObject *oa, *ob;
    if (!PyArg_ParseTuple(args, "OO:same", &oa, &ob))
        return NULL;
    Py_buffer a, b;
    if (PyObject_GetBuffer(oa, &a, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(ob, &b, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    int eq = a.len == b.len && memcmp(a.buf, b.buf, (size_t)a.len) == 0;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(eq);
}

static PyObject *fence(PyObject *self, PyObject *unused)
{
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(ids, slot_map, pos_out, ids_out, counts_out): ids grouped by partition."},
    {"gather", gather, METH_VARARGS, "gather(src, pos, out): out[i] = src[pos[i]]."},
    {"scatter", scatter, METH_VARARGS, "scatter(dst, pos, src): dst[pos[i]] = src[i]."},
    {"copy_finite", copy_finite, METH_VARARGS,
     "copy_finite(dst, src, itemsize) -> bool: dst[:] = src; whether every float is finite."},
    {"same", same, METH_VARARGS, "same(a, b) -> bool: the same bytes (C-contiguous)."},
    {"fence", fence, METH_NOARGS, "fence(): a full memory barrier."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps.core._rows",
    "Row routing, compiled (see zps/core/rows.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
