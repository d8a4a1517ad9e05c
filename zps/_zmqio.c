/* A channel's send and receive of one message as one call each (zps.transport).
 *
 * pyzmq sends and receives a message frame by frame, each frame a Python call with
 * its own checks (and a zmq.Frame object per received frame): for the small
 * messages that are most of zps's traffic (a request's route, header and ids; a
 * reply whose rows are in shared memory) that is a third to a half of a send's and
 * a receive's thread CPU (bench/transport_io.py).  Here:
 *
 *   recv(sock, big)          one whole message, non-blocking: a list of its frames,
 *                            each as bytes (a copy) or, from ``big`` bytes on, as a
 *                            Frame holding libzmq's message (no copy; the buffer
 *                            protocol reads it).  None: nothing queued (EAGAIN).  An
 *                            int (-errno): the first part failed, nothing taken.
 *   send(sock, frames, big)  every frame (buffers), non-blocking, copied: 1 sent;
 *                            0 declined, nothing sent (a frame of ``big`` bytes or
 *                            more, one that is not a contiguous buffer, or too many
 *                            frames: the caller sends it its own way); -errno: the
 *                            first frame failed (EAGAIN: the peer's queue is full;
 *                            EHOSTUNREACH: a ROUTER has no such peer), nothing sent.
 *   events(sock)             ZMQ_EVENTS, or -1 when the socket failed.
 *
 * It decides nothing: the caller (transport.Channel) keeps its rules and hands every
 * other case to pyzmq, which reports errors as it always did.  ``sock`` is the address
 * of pyzmq's own socket (Socket.underlying), never a closed one, used on the thread
 * that owns it, with the GIL held.  libzmq is the one pyzmq loaded: bind() opens it
 * with RTLD_NOLOAD (the same instance) and resolves the few functions used here.
 * Optional: without a compiler (or without a loadable libzmq) pyzmq does it all.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>

#include "_libzmq.h"

/* A message of more frames than this goes through pyzmq. */
#define MAX_FRAMES 64

static PyObject *bind(PyObject *self, PyObject *arg) { return libzmq_bind(arg); }

static PyObject *bound(PyObject *self, PyObject *unused) { return libzmq_bound(); }

/* -- Frame: a received libzmq message, read through the buffer protocol ----------- */

typedef struct {
    PyObject_HEAD zmsg msg;
} Frame;

static void frame_dealloc(Frame *f)
{
    z_msg_close(&f->msg);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static int frame_getbuffer(Frame *f, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)f, z_msg_data(&f->msg),
                             (Py_ssize_t)z_msg_size(&f->msg), 1, flags);
}

static Py_ssize_t frame_len(Frame *f) { return (Py_ssize_t)z_msg_size(&f->msg); }

static PyBufferProcs frame_as_buffer = {(getbufferproc)frame_getbuffer, NULL};
static PySequenceMethods frame_as_sequence = {(lenfunc)frame_len};

static PyTypeObject FrameType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "zps._zmqio.Frame",
    .tp_basicsize = sizeof(Frame),
    .tp_dealloc = (destructor)frame_dealloc,
    .tp_as_sequence = &frame_as_sequence,
    .tp_as_buffer = &frame_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received frame, its bytes read in place (the buffer protocol).",
};

/* -- recv, send, events ------------------------------------------------------------ */

/* The rest of a message whose frame could not be kept: taken and dropped, so that the
 * next receive starts at a message's first frame. */
static void drain(void *sock, int more)
{
    while (more) {
        zmsg m;
        z_msg_init(&m);
        if (z_msg_recv(&m, sock, Z_DONTWAIT) < 0) {
            z_msg_close(&m);
            return;
        }
        more = z_msg_more(&m);
        z_msg_close(&m);
    }
}

static PyObject *recv(PyObject *self, PyObject *args)
{
    Py_ssize_t addr, big;
    if (!PyArg_ParseTuple(args, "nn:recv", &addr, &big))
        return NULL;
    void *sock = (void *)addr;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (;;) {
        zmsg m;
        z_msg_init(&m);
        if (z_msg_recv(&m, sock, Z_DONTWAIT) < 0) {
            int e = z_errno();
            z_msg_close(&m);
            if (PyList_GET_SIZE(out) == 0) {
                Py_DECREF(out);
                if (e == EAGAIN)
                    Py_RETURN_NONE;
                return PyLong_FromLong(-e);
            }
            /* A message's later frames are queued with its first: not seen to fail. */
            Py_DECREF(out);
            errno = e;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        int more = z_msg_more(&m);
        size_t size = z_msg_size(&m);
        PyObject *f;
        if ((Py_ssize_t)size >= big) {
            Frame *held = PyObject_New(Frame, &FrameType);
            if (held != NULL) {
                z_msg_init(&held->msg);
                z_msg_move(&held->msg, &m);
            }
            f = (PyObject *)held;
        } else {
            f = PyBytes_FromStringAndSize(z_msg_data(&m), (Py_ssize_t)size);
        }
        z_msg_close(&m);
        if (f == NULL || PyList_Append(out, f) < 0) {
            Py_XDECREF(f);
            Py_DECREF(out);
            drain(sock, more);
            return NULL;
        }
        Py_DECREF(f);
        if (!more)
            return out;
    }
}

static PyObject *send(PyObject *self, PyObject *args)
{
    Py_ssize_t addr, big;
    PyObject *frames;
    if (!PyArg_ParseTuple(args, "nOn:send", &addr, &frames, &big))
        return NULL;
    void *sock = (void *)addr;
    PyObject *seq = PySequence_Fast(frames, "frames must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer views[MAX_FRAMES];
    Py_ssize_t got = 0;
    long rc = 0; /* declined unless every frame is a small contiguous buffer */
    if (n == 0 || n > MAX_FRAMES)
        goto done;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            goto done;
        }
        if (views[got].len >= big) {
            got++;
            goto done;
        }
    }
    rc = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = i < n - 1 ? Z_DONTWAIT | Z_SNDMORE : Z_DONTWAIT;
        if (z_send(sock, views[i].buf, (size_t)views[i].len, flags) < 0) {
            int e = z_errno();
            if (i == 0) {
                rc = -e;
            } else { /* a message's later frames go where its first went: not seen */
                errno = e;
                PyErr_SetFromErrno(PyExc_OSError);
                rc = 2;
            }
            break;
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return rc == 2 ? NULL : PyLong_FromLong(rc);
}

static PyObject *events(PyObject *self, PyObject *arg)
{
    Py_ssize_t addr = PyLong_AsSsize_t(arg);
    if (addr == -1 && PyErr_Occurred())
        return NULL;
    int ev = 0;
    size_t size = sizeof(ev);
    if (z_getsockopt((void *)addr, Z_EVENTS, &ev, &size) != 0)
        ev = -1;
    return PyLong_FromLong(ev);
}

static PyMethodDef methods[] = {
    {"bound", bound, METH_NOARGS, "bound() -> the file of the libzmq bound, or None."},
    {"bind", bind, METH_O,
     "bind(path): use the libzmq at path (already loaded); its version, or False."},
    {"recv", recv, METH_VARARGS, "recv(sock, big): one whole message (see the module)."},
    {"send", send, METH_VARARGS, "send(sock, frames, big): 1 sent, 0 declined, -errno."},
    {"events", events, METH_O, "events(sock): ZMQ_EVENTS, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps._zmqio",
    "A channel's send and receive of one message as one call each (see zps.transport).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__zmqio(void)
{
    if (PyType_Ready(&FrameType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FrameType);
    if (PyModule_AddObject(m, "Frame", (PyObject *)&FrameType) < 0) {
        Py_DECREF(&FrameType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
