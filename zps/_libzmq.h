/* The libzmq that pyzmq calls, for compiled code that drives pyzmq's own sockets
 * (zps._zmqio: a channel's send and receive; zps.broker._forward: the broker's data
 * path).  Included by each of them: every translation unit gets its own pointers.
 *
 * libzmq_bind(path) opens the library at path only if this process has loaded it
 * already (RTLD_NOLOAD: no second copy) and looks every function used here up through
 * its handle, which searches that library and then the ones it depends on, in load
 * order.  zps.transport passes pyzmq's backend module, so the functions found are the
 * ones pyzmq's sockets run on (linked into the module or a library it needs), whatever
 * other libzmq the process holds.  A library without all of them leaves the bound one
 * as it was.  It returns the version bound, or False; the caller checks it against
 * pyzmq's.  libzmq_bound() names the file the bound functions are in (dladdr), for the
 * log and the tests.  See docs/design.md for the rules such code follows: the owning
 * thread, the GIL held, non-blocking, never a closed socket, nothing decided that the
 * Python path does not.
 */
#ifndef ZPS_LIBZMQ_H
#define ZPS_LIBZMQ_H

#include <Python.h>
#include <dlfcn.h>

/* zmq.h's zmq_msg_t: 64 opaque bytes, pointer-aligned (ABI-stable since libzmq 4.1). */
typedef struct {
    unsigned char _[64];
} __attribute__((aligned(sizeof(void *)))) zmsg;

#define Z_DONTWAIT 1
#define Z_SNDMORE 2
#define Z_EVENTS 15
#define Z_POLLIN 1

#define Z_UNUSED __attribute__((unused))
static int (*z_msg_init)(zmsg *) Z_UNUSED;
static int (*z_msg_init_size)(zmsg *, size_t) Z_UNUSED;
static int (*z_msg_recv)(zmsg *, void *, int) Z_UNUSED;
static int (*z_msg_send)(zmsg *, void *, int) Z_UNUSED;
static int (*z_msg_close)(zmsg *) Z_UNUSED;
static int (*z_msg_move)(zmsg *, zmsg *) Z_UNUSED;
static void *(*z_msg_data)(zmsg *) Z_UNUSED;
static size_t (*z_msg_size)(const zmsg *) Z_UNUSED;
static int (*z_msg_more)(const zmsg *) Z_UNUSED;
static int (*z_send)(void *, const void *, size_t, int) Z_UNUSED;
static int (*z_getsockopt)(void *, int, void *, size_t *) Z_UNUSED;
static int (*z_errno)(void) Z_UNUSED;
static void (*z_version)(int *, int *, int *) Z_UNUSED;
static void *z_lib;

static PyObject *libzmq_bind(PyObject *arg)
{
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE; /* not loaded in this process: not pyzmq's */
    static const char *const names[] = {
        "zmq_msg_init", "zmq_msg_init_size", "zmq_msg_recv", "zmq_msg_send", "zmq_msg_close",
        "zmq_msg_move", "zmq_msg_data",      "zmq_msg_size", "zmq_msg_more", "zmq_send",
        "zmq_getsockopt", "zmq_errno",       "zmq_version",
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (dlsym(lib, names[i]) == NULL) {
            dlclose(lib);
            Py_RETURN_FALSE;
        }
    }
#define SYM(var, name) *(void **)&var = dlsym(lib, name)
    SYM(z_msg_init, "zmq_msg_init");
    SYM(z_msg_init_size, "zmq_msg_init_size");
    SYM(z_msg_recv, "zmq_msg_recv");
    SYM(z_msg_send, "zmq_msg_send");
    SYM(z_msg_close, "zmq_msg_close");
    SYM(z_msg_move, "zmq_msg_move");
    SYM(z_msg_data, "zmq_msg_data");
    SYM(z_msg_size, "zmq_msg_size");
    SYM(z_msg_more, "zmq_msg_more");
    SYM(z_send, "zmq_send");
    SYM(z_getsockopt, "zmq_getsockopt");
    SYM(z_errno, "zmq_errno");
    SYM(z_version, "zmq_version");
#undef SYM
    if (z_lib != NULL)
        dlclose(z_lib);
    z_lib = lib;
    int major, minor, patch;
    z_version(&major, &minor, &patch);
    return Py_BuildValue("(iii)", major, minor, patch);
}

/* The file the bound functions are in, or None before a bind. */
static Z_UNUSED PyObject *libzmq_bound(void)
{
    Dl_info info;
    void *fn = *(void **)&z_msg_send;
    if (z_lib == NULL || fn == NULL || dladdr(fn, &info) == 0 || info.dli_fname == NULL)
        Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(info.dli_fname);
}

#endif
