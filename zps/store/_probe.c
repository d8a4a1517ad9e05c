/* The id index's lookup and insertion (zps.store.index.IdIndex) in one pass per id.
 *
 * The index is an open-addressing table of 16-byte slots (key, position), capacity a
 * power of two, linear probing, keys placed at mix64(key) & (capacity - 1), free slots
 * holding key INT64_MIN and position -1 (see index.py).  lookup(slots, keys, out)
 * writes each key's position, or -1 where it is absent, exactly as the numpy
 * version does.  place(slots, keys, first) writes keys that are absent and unique
 * into the first free slot of their probe sequences, with the positions first,
 * first + 1, ...: a batch of new ids, or every id when the table is rehashed.  The
 * slots it picks may differ from the numpy version's (which settles collisions a
 * probe round at a time); every lookup gives the same positions either way.  All
 * buffers are C-contiguous int64: slots of 2 * capacity items, keys and out of n
 * items each.  Optional: without a compiler zps uses the numpy versions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY INT64_MIN
/* Home slots of this many ids are prefetched ahead of their probe. */
#define AHEAD 16

static inline uint64_t mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The home slots of the first AHEAD keys, then (in the loop over i) of key i + AHEAD,
 * fetched ahead of their probes; rw 1 for slots about to be written. */
#define PREFETCH_FIRST(s, k, n, mask, rw)                                         \
    for (Py_ssize_t i_ = 0; i_ < (n) && i_ < AHEAD; i_++)                         \
        __builtin_prefetch((s) + 2 * (mix64((uint64_t)(k)[i_]) & (mask)), (rw))
#define PREFETCH_NEXT(s, k, n, i, mask, rw)                                       \
    if ((i) + AHEAD < (n))                                                        \
        __builtin_prefetch((s) + 2 * (mix64((uint64_t)(k)[(i) + AHEAD]) & (mask)), (rw))

static int get_int64(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "l") != 0 && strcmp(view->format, "q") != 0 &&
         strcmp(view->format, "<l") != 0 && strcmp(view->format, "<q") != 0 &&
         strcmp(view->format, "=l") != 0 && strcmp(view->format, "=q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a buffer of int64", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The n int64 buffers of objs (writable where "w" in modes), named for errors; on a
 * failure the ones taken are released and -1 returned. */
static int get_all(int n, PyObject *const *objs, Py_buffer *views, const char *modes,
                   const char *const *names)
{
    for (int i = 0; i < n; i++) {
        if (get_int64(objs[i], &views[i], modes[i] == 'w', names[i]) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_all(int n, Py_buffer *views)
{
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

static PyObject *lookup(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    Py_buffer b[3];
    static const char *const names[] = {"slots", "keys", "out"};
    if (!PyArg_ParseTuple(args, "OOO:lookup", &objs[0], &objs[1], &objs[2]))
        return NULL;
    if (get_all(3, objs, b, "rrw", names) < 0)
        return NULL;
    Py_buffer slots = b[0], keys = b[1], out = b[2];
    Py_ssize_t cap = slots.len / 16, n = keys.len / 8;
    if (cap < 1 || (cap & (cap - 1)) != 0 || out.len != keys.len) {
        PyErr_SetString(PyExc_ValueError,
                        "slots must hold a power of two of (key, position) pairs and out "
                        "as many items as keys");
        release_all(3, b);
        return NULL;
    }
    const int64_t *s = (const int64_t *)slots.buf;
    const int64_t *k = (const int64_t *)keys.buf;
    int64_t *o = (int64_t *)out.buf;
    uint64_t mask = (uint64_t)cap - 1;

    Py_BEGIN_ALLOW_THREADS
    PREFETCH_FIRST(s, k, n, mask, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        PREFETCH_NEXT(s, k, n, i, mask, 0);
        int64_t key = k[i];
        uint64_t slot = mix64((uint64_t)key) & mask;
        /* The load factor stays <= 1/2, so a free slot ends every probe sequence;
         * a free slot's position is -1, "absent" (EMPTY itself is never stored). */
        for (;;) {
            int64_t found = s[2 * slot];
            if (found == key || found == EMPTY) {
                o[i] = s[2 * slot + 1];
                break;
            }
            slot = (slot + 1) & mask;
        }
    }
    Py_END_ALLOW_THREADS

    release_all(3, b);
    Py_RETURN_NONE;
}

static PyObject *place(PyObject *self, PyObject *args)
{
    PyObject *objs[2];
    long long first;
    Py_buffer b[2];
    static const char *const names[] = {"slots", "keys"};
    if (!PyArg_ParseTuple(args, "OOL:place", &objs[0], &objs[1], &first))
        return NULL;
    if (get_all(2, objs, b, "wr", names) < 0)
        return NULL;
    Py_buffer slots = b[0], keys = b[1];
    Py_ssize_t cap = slots.len / 16, n = keys.len / 8;
    /* first + n, the position after the last one written, must be an int64 (no wrap). */
    if (cap < 1 || (cap & (cap - 1)) != 0 || first < 0 || first > INT64_MAX - n) {
        PyErr_SetString(PyExc_ValueError,
                        "slots must hold a power of two of (key, position) pairs and the "
                        "positions first, first + 1, ... must be int64 values >= 0");
        release_all(2, b);
        return NULL;
    }
    int64_t *s = (int64_t *)slots.buf;
    const int64_t *k = (const int64_t *)keys.buf;
    uint64_t mask = (uint64_t)cap - 1;
    Py_ssize_t full = -1; /* the key that found no free slot (the caller's load factor broken) */
    int64_t dup = 0, dup_at = -1; /* a key already present (not absent, or twice in keys) */

    Py_BEGIN_ALLOW_THREADS
    PREFETCH_FIRST(s, k, n, mask, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        PREFETCH_NEXT(s, k, n, i, mask, 1);
        int64_t key = k[i];
        uint64_t slot = mix64((uint64_t)key) & mask;
        Py_ssize_t probes = 0;
        while (s[2 * slot] != EMPTY && s[2 * slot] != key && ++probes < cap)
            slot = (slot + 1) & mask;
        if (probes >= cap) {
            full = i;
            break;
        }
        if (s[2 * slot] == key) {
            dup = key;
            dup_at = s[2 * slot + 1];
            break;
        }
        s[2 * slot] = key;
        s[2 * slot + 1] = (int64_t)first + i;
    }
    Py_END_ALLOW_THREADS

    release_all(2, b);
    if (full >= 0) {
        PyErr_Format(PyExc_ValueError, "index full: no free slot for key %zd of %zd", full, n);
        return NULL;
    }
    if (dup_at >= 0) {
        PyErr_Format(PyExc_ValueError, "key %lld is already in the index (position %lld)",
                     (long long)dup, (long long)dup_at);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* get_or_insert(slots, ids, n, keys, out) -> inserted: each key's position in out,
 * inserting absent keys once each, in first-occurrence order, with positions n, n + 1,
 * ..., and recording them in ids[n], ids[n + 1], ... (the index's id by position).
 * The caller makes room for every key first: ids of at least n + len(keys) items,
 * and a capacity of at least twice that, so the load factor stays <= 1/2 (or 3/4
 * while the index builds its next table: see zps/store/index.py). */
static PyObject *get_or_insert(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    long long n0;
    Py_buffer b[4];
    static const char *const names[] = {"slots", "ids", "keys", "out"};
    if (!PyArg_ParseTuple(args, "OOLOO:get_or_insert", &objs[0], &objs[1], &n0, &objs[2],
                          &objs[3]))
        return NULL;
    if (get_all(4, objs, b, "wwrw", names) < 0)
        return NULL;
    Py_buffer slots = b[0], ids = b[1], keys = b[2], out = b[3];
    /* Every count is a number of items of a buffer that exists, compared without an
     * addition that could wrap: n0 and n are checked against the room in ids first, so
     * their sum and four times it fit (buffers hold at most PY_SSIZE_T_MAX bytes). */
    Py_ssize_t cap = slots.len / 16, n = keys.len / 8, room = ids.len / 8;
    if (n0 < 0 || (unsigned long long)n0 > (unsigned long long)room ||
        n > room - (Py_ssize_t)n0) {
        PyErr_Format(PyExc_ValueError,
                     "ids has room for %zd items, not the %lld already there and the "
                     "%zd keys",
                     room, n0, n);
        release_all(4, b);
        return NULL;
    }
    Py_ssize_t total = (Py_ssize_t)n0 + n;
    if (cap < 1 || (cap & (cap - 1)) != 0 || out.len != keys.len || 4 * total > 3 * cap) {
        PyErr_SetString(PyExc_ValueError,
                        "slots must hold a power of two of (key, position) pairs, at least "
                        "4/3 of the ids after the insert, ids room for every key and out "
                        "as many items as keys");
        release_all(4, b);
        return NULL;
    }
    int64_t *s = (int64_t *)slots.buf;
    int64_t *by_pos = (int64_t *)ids.buf;
    const int64_t *k = (const int64_t *)keys.buf;
    int64_t *o = (int64_t *)out.buf;
    uint64_t mask = (uint64_t)cap - 1;
    int64_t next = (int64_t)n0;

    Py_BEGIN_ALLOW_THREADS
    PREFETCH_FIRST(s, k, n, mask, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        PREFETCH_NEXT(s, k, n, i, mask, 1);
        int64_t key = k[i];
        uint64_t slot = mix64((uint64_t)key) & mask;
        /* At most half the slots are taken, even after this batch: a probe ends. */
        while (s[2 * slot] != EMPTY && s[2 * slot] != key)
            slot = (slot + 1) & mask;
        if (s[2 * slot] == EMPTY) {
            s[2 * slot] = key;
            s[2 * slot + 1] = next;
            by_pos[next++] = key;
        }
        o[i] = s[2 * slot + 1];
    }
    Py_END_ALLOW_THREADS

    release_all(4, b);
    return PyLong_FromLongLong((long long)(next - n0));
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS,
     "lookup(slots, keys, out): each key's position in the index slots, or -1."},
    {"place", place, METH_VARARGS,
     "place(slots, keys, first): insert absent, unique keys with positions first, "
     "first + 1, ..."},
    {"get_or_insert", get_or_insert, METH_VARARGS,
     "get_or_insert(slots, ids, n, keys, out) -> inserted: positions, absent keys "
     "inserted once each in first-occurrence order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps.store._probe",
    "The id index's lookup and insertion, compiled (see zps/store/index.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
