/* The broker's data path as one compiled step (zps.broker.forward).
 *
 * pump() takes the messages queued on the broker's ROUTER socket and forwards the two
 * kinds that make up nearly all of its traffic, exactly as the broker's Python fast
 * path does (zps.broker.datapath, by the rules of zps.broker.acceptance and
 * zps.broker.routes):
 *
 *   a client's REQUEST  [client, route, ...] -> [primary of route's partition, client, route, ...]
 *   a shard's reply     [shard, client, ...] -> [client, ...]
 *
 * The frames are moved, not copied (zmq_msg_send takes each received zmq_msg_t).  Any
 * other message, and any of these two that needs a decision the Python code makes
 * (no primary, the broker holding, a peer with messages held for it, a full or gone
 * peer queue, a reply from a shard not in the membership, a malformed or other-version
 * route frame), is received but not forwarded: pump() returns it, as a list of bytes,
 * and the caller hands it to the Python path, which decides.  Nothing is sent for a
 * returned message, so that decision is the only one.  Where a request goes is the
 * route table's word (zps.broker.routes): routes[p] is the identity its rule gives
 * partition p outside the hold, or None when the rule refuses (the Python path says
 * why); this step only reads it.
 *
 * libzmq is the one pyzmq loaded: bind() opens it with RTLD_NOLOAD (the same instance,
 * whose sockets pyzmq's are) and resolves the few functions used here; the socket is
 * pyzmq's own (Socket.underlying).  Everything runs on the broker's thread, with the
 * GIL held, non-blocking.  Optional: without a compiler (or without a loadable libzmq)
 * the broker forwards in Python.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "../_libzmq.h"

/* What this step shares with the Python code, each checked against it by
 * tests/unit/test_forward_wire.py (a change on one side alone fails there).
 *
 * The route frame (zps.protocol.codec.ROUTE, "<2sBBiIQ"): magic, version, type,
 * partition (little-endian int32), epoch, request id. */
#define ROUTE_SIZE 20             /* codec.ROUTE.size */
#define ROUTE_MAGIC "ZP"          /* codec.MAGIC */
#define ROUTE_MAGIC_LEN 2
#define ROUTE_VERSION_AT 2        /* offset of the version byte */
#define PROTOCOL_VERSION 1        /* codec.PROTOCOL_VERSION */
#define ROUTE_TYPE_AT 3           /* offset of the message type byte */
#define MSG_REQUEST 1             /* codec.MsgType.REQUEST */
#define ROUTE_PARTITION_AT 4      /* offset of the partition */
/* Identities (zps.core.membership): a shard's, and a shard's liveness link's. */
#define SHARD_PREFIX "s-"         /* membership.SHARD_PREFIX */
#define SHARD_PREFIX_LEN 2
#define LIVENESS_PREFIX "h-s-"    /* membership.LIVENESS_PREFIX + SHARD_PREFIX */
#define LIVENESS_PREFIX_LEN 4
/* A shard's target frame starting with this byte names a pseudo client of the broker
 * (acceptance.COMMIT_TARGET, MOVE_TARGET): never forwarded here. */
#define PSEUDO_TARGET '\0'

static PyObject *bind(PyObject *self, PyObject *arg) { return libzmq_bind(arg); }

static PyObject *bound(PyObject *self, PyObject *unused) { return libzmq_bound(); }

/* ZMQ_EVENTS, or -1 when the socket failed. */
static int events_of(void *sock)
{
    int events = 0;
    size_t size = sizeof(events);
    if (z_getsockopt(sock, Z_EVENTS, &events, &size) != 0)
        return -1;
    return events;
}

static void close_all(zmsg *m, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        z_msg_close(&m[i]);
}

/* The frames as bytes (copies), the messages closed; NULL on a memory error. */
static PyObject *as_list(zmsg *m, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = PyBytes_FromStringAndSize(z_msg_data(&m[i]), z_msg_size(&m[i]));
            if (b == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, b);
        }
    }
    close_all(m, n);
    return out;
}

static int starts(zmsg *m, const char *prefix, size_t len)
{
    return z_msg_size(m) >= len && memcmp(z_msg_data(m), prefix, len) == 0;
}

/* Whether the peer named by m's bytes has messages held for it (queues: the broker's
 * Outbound's held queues, keyed by identity); -1 on a memory error. */
static int held(PyObject *queues, zmsg *m)
{
    if (PyDict_GET_SIZE(queues) == 0)
        return 0;
    PyObject *key = PyBytes_FromStringAndSize(z_msg_data(m), z_msg_size(m));
    if (key == NULL)
        return -1;
    int in = PyDict_Contains(queues, key);
    Py_DECREF(key);
    return in;
}

/* Send m[from..n) after whatever was sent with SNDMORE; the message's first frame went
 * out, so zmq takes the rest (a ROUTER decides at the first). */
static void send_rest(void *sock, zmsg *m, Py_ssize_t from, Py_ssize_t n)
{
    for (Py_ssize_t i = from; i < n; i++)
        z_msg_send(&m[i], sock, Z_DONTWAIT | (i + 1 < n ? Z_SNDMORE : 0));
    close_all(m, n);
}

enum { DECLINE = 0, ROUTED = 1, REPLIED = 2, FAILED = -1 };

/* One message m[0..n): forwarded (ROUTED, REPLIED), left to Python (DECLINE: nothing
 * sent), or FAILED (a Python error is set).  node: the sender's identity as text, set
 * when forwarded. */
static int forward(void *sock, zmsg *m, Py_ssize_t n, PyObject *routes, PyObject *shards,
                   PyObject *queues, int holding, PyObject **node)
{
    if (n < 3)
        return DECLINE;
    const char *id = z_msg_data(&m[0]);
    size_t id_len = z_msg_size(&m[0]);
    if (starts(&m[0], SHARD_PREFIX, SHARD_PREFIX_LEN)) {
        /* A shard's reply: [shard, client, ...] -> [client, ...]. */
        size_t t_len = z_msg_size(&m[1]);
        const char *t = z_msg_data(&m[1]);
        if (t_len == 0 || t[0] == PSEUDO_TARGET ||
            starts(&m[1], SHARD_PREFIX, SHARD_PREFIX_LEN))
            return DECLINE; /* control, commit or move answers, replies to shards */
        *node = PyUnicode_DecodeUTF8(id, (Py_ssize_t)id_len, "replace");
        if (*node == NULL)
            return FAILED;
        int member = PyDict_Contains(shards, *node);
        int busy = member == 1 ? held(queues, &m[1]) : 0;
        if (member < 0 || busy < 0)
            return FAILED;
        if (member == 0 || busy)
            return DECLINE;
        if (z_msg_send(&m[1], sock, Z_DONTWAIT | Z_SNDMORE) < 0)
            return DECLINE; /* full or gone: the Python path holds, drops or counts it */
        send_rest(sock, m, 2, n);
        return REPLIED;
    }
    if (starts(&m[0], LIVENESS_PREFIX, LIVENESS_PREFIX_LEN))
        return DECLINE; /* a shard's liveness link */
    /* A client's message: a REQUEST of this protocol version goes to its primary. */
    const unsigned char *r = z_msg_data(&m[1]);
    if (z_msg_size(&m[1]) != ROUTE_SIZE || memcmp(r, ROUTE_MAGIC, ROUTE_MAGIC_LEN) != 0 ||
        r[ROUTE_VERSION_AT] != PROTOCOL_VERSION || r[ROUTE_TYPE_AT] != MSG_REQUEST || holding)
        return DECLINE;
    const unsigned char *pr = r + ROUTE_PARTITION_AT;
    int32_t p = (int32_t)((uint32_t)pr[0] | (uint32_t)pr[1] << 8 | (uint32_t)pr[2] << 16 |
                          (uint32_t)pr[3] << 24);
    if (p < 0 || p >= PyList_GET_SIZE(routes))
        return DECLINE;
    PyObject *target = PyList_GET_ITEM(routes, p);
    if (!PyBytes_Check(target))
        return DECLINE; /* no primary: the route table says why (zps.broker.routes) */
    if (PyDict_GET_SIZE(queues) != 0) {
        int busy = PyDict_Contains(queues, target);
        if (busy < 0)
            return FAILED;
        if (busy)
            return DECLINE;
    }
    *node = PyUnicode_DecodeUTF8(id, (Py_ssize_t)id_len, "replace");
    if (*node == NULL)
        return FAILED;
    zmsg t;
    Py_ssize_t t_len = PyBytes_GET_SIZE(target);
    if (z_msg_init_size(&t, (size_t)t_len) != 0) {
        PyErr_NoMemory();
        return FAILED;
    }
    memcpy(z_msg_data(&t), PyBytes_AS_STRING(target), (size_t)t_len);
    if (z_msg_send(&t, sock, Z_DONTWAIT | Z_SNDMORE) < 0) {
        z_msg_close(&t);
        return DECLINE; /* full or gone: the Python path decides */
    }
    send_rest(sock, m, 0, n);
    return ROUTED;
}

#define FRAMES 16

/* pump(sock, limit, routes, shards, last, queues, holding, now)
 *     -> (events, routed, replies, declined)
 *
 * Forwards queued messages until none is left (events: the last ZMQ_EVENTS reading),
 * ``limit`` were forwarded (events: 0; more may be queued), or one is declined
 * (declined: its frames as bytes; events: 0).  events is -1 when the socket failed
 * (the caller's own receive reports it).  routes: the route table's targets
 * (zps.broker.routes.RouteTable.targets: the primary's identity, bytes, or None);
 * shards: the membership (names); last: the failure detector's last-heard times, set
 * to ``now`` for each sender forwarded; queues: the identities with messages held for
 * them; holding: the broker is collecting claims. */
static PyObject *pump(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "pump takes 8 arguments");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    PyObject *routes = args[2], *shards = args[3], *last = args[4], *queues = args[5];
    int holding = PyObject_IsTrue(args[6]);
    PyObject *now = args[7];
    if (PyErr_Occurred())
        return NULL;
    if (z_lib == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "libzmq is not bound (bind() first)");
        return NULL;
    }
    if (!PyList_Check(routes) || !PyDict_Check(shards) || !PyDict_Check(last) ||
        !PyDict_Check(queues)) {
        PyErr_SetString(PyExc_TypeError, "pump needs a list and three dicts");
        return NULL;
    }
    zmsg stack[FRAMES], *m = stack;
    Py_ssize_t cap = FRAMES;
    long routed = 0, replies = 0;
    int events = 0;
    PyObject *declined = Py_None;
    Py_INCREF(declined);
    while (routed + replies < limit) {
        Py_ssize_t n = 0;
        for (;;) {
            if (n == cap) {
                zmsg *bigger = PyMem_Malloc(2 * cap * sizeof(zmsg));
                if (bigger == NULL) {
                    close_all(m, n);
                    PyErr_NoMemory();
                    goto fail;
                }
                memcpy(bigger, m, n * sizeof(zmsg)); /* zmq_msg_t moves by copy */
                if (m != stack)
                    PyMem_Free(m);
                m = bigger;
                cap *= 2;
            }
            z_msg_init(&m[n]);
            if (z_msg_recv(&m[n], sock, Z_DONTWAIT) < 0) {
                int err = z_errno();
                z_msg_close(&m[n]);
                close_all(m, n);
                if (n == 0 && err == EAGAIN) {
                    events = events_of(sock);
                    goto done;
                }
                events = -1; /* the caller's receive raises it */
                goto done;
            }
            int more = z_msg_more(&m[n]);
            n++;
            if (!more)
                break;
        }
        PyObject *node = NULL;
        int verdict = forward(sock, m, n, routes, shards, queues, holding, &node);
        if (verdict == FAILED) {
            Py_XDECREF(node);
            close_all(m, n);
            goto fail;
        }
        if (verdict == DECLINE) {
            Py_XDECREF(node);
            Py_DECREF(declined);
            declined = as_list(m, n);
            if (declined == NULL)
                goto fail;
            events = 0;
            goto done;
        }
        int set = PyDict_SetItem(last, node, now);
        Py_DECREF(node);
        if (set < 0)
            goto fail;
        if (verdict == ROUTED)
            routed++;
        else
            replies++;
        events = events_of(sock);
        if (events < 0 || !(events & Z_POLLIN))
            goto done;
    }
    events = 0; /* the limit: more may be queued */
done:
    if (m != stack)
        PyMem_Free(m);
    PyObject *out = Py_BuildValue("(illN)", events, routed, replies, declined);
    return out;
fail:
    if (m != stack)
        PyMem_Free(m);
    Py_DECREF(declined);
    return NULL;
}

static PyMethodDef methods[] = {
    {"bound", bound, METH_NOARGS, "bound() -> the file of the libzmq bound, or None."},
    {"bind", bind, METH_O,
     "bind(path) -> (major, minor, patch) or False: use the libzmq already loaded from "
     "path."},
    {"pump", (PyCFunction)(void (*)(void))pump, METH_FASTCALL,
     "pump(sock, limit, routes, shards, last, queues, holding, now) -> (events, routed, "
     "replies, declined): forward queued requests and replies (see the module notes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zps.broker._forward",
    "The broker's data path as one compiled step (see zps.broker.forward).", -1, methods,
};

PyMODINIT_FUNC PyInit__forward(void)
{
    return PyModule_Create(&module);
}
