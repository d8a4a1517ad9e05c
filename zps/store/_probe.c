/* The id index's lookup (zps.store.index.IdIndex.lookup) in one pass per id.
 *
 * The index is an open-addressing table of 16-byte slots (key, position), capacity a
 * power of two, linear probing, keys placed at mix64(key) & (capacity - 1), free slots
 * holding key INT64_MIN and position -1 (see index.py).  lookup(slots, keys, out)
 * writes each key's position, or -1 where it is absent, exactly as the numpy
 * version does.  All three arguments are C-contiguous buffers of int64: slots of
 * 2 * capacity items, keys and out of n items each.  Optional: without a compiler
 * zps uses the numpy version (the results are the same).
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

static PyObject *lookup(PyObject *self, PyObject *args)
{
    PyObject *slots_obj, *keys_obj, *out_obj;
    Py_buffer slots, keys, out;
    if (!PyArg_ParseTuple(args, "OOO:lookup", &slots_obj, &keys_obj, &out_obj))
        return NULL;
    if (get_int64(slots_obj, &slots, 0, "slots") < 0)
        return NULL;
    if (get_int64(keys_obj, &keys, 0, "keys") < 0) {
        PyBuffer_Release(&slots);
        return NULL;
    }
    if (get_int64(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&slots);
        PyBuffer_Release(&keys);
        return NULL;
    }
    Py_ssize_t cap = slots.len / 16, n = keys.len / 8;
    if (cap < 1 || (cap & (cap - 1)) != 0 || out.len != keys.len) {
        PyErr_SetString(PyExc_ValueError,
                        "slots must hold a power of two of (key, position) pairs and out "
                        "as many items as keys");
        PyBuffer_Release(&slots);
        PyBuffer_Release(&keys);
        PyBuffer_Release(&out);
        return NULL;
    }
    const int64_t *s = (const int64_t *)slots.buf;
    const int64_t *k = (const int64_t *)keys.buf;
    int64_t *o = (int64_t *)out.buf;
    uint64_t mask = (uint64_t)cap - 1;

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i]) & mask));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(s + 2 * (mix64((uint64_t)k[i + AHEAD]) & mask));
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

    PyBuffer_Release(&slots);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"lookup", lookup, METH_VARARGS,
     "lookup(slots, keys, out): each key's position in the index slots, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps.store._probe",
    "The id index's lookup, compiled (see zps/store/index.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
