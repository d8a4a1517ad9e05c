# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""A channel's send and receive of one message as one call each (see zps.transport).

pyzmq sends and receives a message frame by frame, each frame a Python call with its own
checks (and a zmq.Frame object per received frame): for the small messages that are most
of zps's traffic (a request's route, header and ids; a reply whose rows are in shared
memory) that is a third to a half of a send's and a receive's thread CPU
(bench/transport_io.py).  Here:

  recv(sock, big)          one whole message, non-blocking: a list of its frames, each as
                           bytes (a copy) or, from ``big`` bytes on, as a Frame holding
                           libzmq's message (no copy; the buffer protocol reads it).  None:
                           nothing queued (EAGAIN).  An int (-errno): the first part
                           failed, nothing taken.
  send(sock, frames, big)  every frame (buffers), non-blocking, copied: 1 sent; 0
                           declined, nothing sent (a frame of ``big`` bytes or more, one
                           that is not a contiguous buffer, or too many frames: the caller
                           sends it its own way); -errno: the first frame failed (EAGAIN:
                           the peer's queue is full; EHOSTUNREACH: a ROUTER has no such
                           peer), nothing sent.
  events(sock)             ZMQ_EVENTS, or -1 when the socket failed.
  bound()                  the file of the libzmq these calls run on.

It decides nothing: the caller (transport.Channel) keeps its rules and hands every other
case to pyzmq, which reports errors as it always did.  ``sock`` is the address of pyzmq's
own socket (Socket.underlying), never a closed one, used on the thread that owns it, with
the GIL held.

libzmq is declared by pyzmq's own ``libzmq.pxd`` and linked by the soname of the libzmq
pyzmq ships (setup.py): ``import zmq`` has loaded that library, so the dynamic linker
resolves this module's calls to the same instance pyzmq's sockets run on.  Optional:
without a compiler, or without a libzmq shipped by pyzmq, pyzmq does it all.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_Clear, PyErr_SetFromErrno
from cpython.object cimport PyObject
from cpython.sequence cimport (
    PySequence_Fast,
    PySequence_Fast_GET_SIZE,
    PySequence_Fast_ITEMS,
)
from libc.errno cimport EAGAIN, errno

from zmq.backend.cython.libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_EVENTS,
    ZMQ_SNDMORE,
    zmq_errno,
    zmq_getsockopt,
    zmq_msg_close,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_more,
    zmq_msg_move,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_send,
)

cdef extern from "Python.h":
    # Without an exception clause: a frame that is not a contiguous buffer is declined
    # (its error cleared), not raised.
    int _get_buffer "PyObject_GetBuffer"(object obj, Py_buffer *view, int flags)
    void PyBuffer_Release(Py_buffer *view)
    enum:
        PyBUF_SIMPLE
        PyBUF_WRITABLE
        PyBUF_FORMAT
        PyBUF_ND
        PyBUF_STRIDES
    object PyUnicode_DecodeFSDefault(const char *s)

cdef extern from "<dlfcn.h>":
    ctypedef struct Dl_info:
        const char *dli_fname
    int dladdr(const void *addr, Dl_info *info)

cdef enum:
    MAX_FRAMES = 64  # a message of more frames than this goes through pyzmq

# Frames are made by recv only.
cdef object _RECV = object()


@cython.auto_pickle(False)
@cython.final
cdef class Frame:
    """A received frame, its bytes read in place (the buffer protocol)."""

    cdef zmq_msg_t msg

    def __cinit__(self, key=None):
        zmq_msg_init(&self.msg)
        if key is not _RECV:
            raise TypeError("cannot create 'zps._zmqio.Frame' instances")

    def __dealloc__(self):
        zmq_msg_close(&self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        # PyBuffer_FillInfo's view of read-only bytes, with the reference to self kept by
        # Cython's own assignment to view.obj.
        if flags & PyBUF_WRITABLE:
            raise BufferError("Object is not writable.")
        view.buf = zmq_msg_data(&self.msg)
        view.obj = self
        view.len = <Py_ssize_t>zmq_msg_size(&self.msg)
        view.readonly = 1
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = b"B"
        view.ndim = 1
        view.shape = NULL
        if flags & PyBUF_ND:
            view.shape = &view.len
        view.strides = NULL
        if flags & PyBUF_STRIDES == PyBUF_STRIDES:
            view.strides = &view.itemsize
        view.suboffsets = NULL
        view.internal = NULL

    def __len__(self):
        return <Py_ssize_t>zmq_msg_size(&self.msg)


cdef int _raise_errno(int e) except -1:
    """Raise libzmq's error ``e`` as pyzmq's fallback would: OSError (or its subclass
    for ``e``), with the system's message."""
    global errno
    errno = e
    PyErr_SetFromErrno(OSError)
    return -1


cdef void _drain(void *sock, int more) noexcept:
    """The rest of a message whose frame could not be kept: taken and dropped, so that the
    next receive starts at a message's first frame."""
    cdef zmq_msg_t m
    while more:
        zmq_msg_init(&m)
        if zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0:
            zmq_msg_close(&m)
            return
        more = zmq_msg_more(&m)
        zmq_msg_close(&m)


cdef object _take(zmq_msg_t *m, Py_ssize_t big):
    """A received frame as bytes (a copy) or, from ``big`` bytes on, as a Frame holding
    libzmq's message (``m`` is left empty)."""
    cdef size_t size = zmq_msg_size(m)
    cdef Frame held
    if <Py_ssize_t>size >= big:
        held = Frame.__new__(Frame, _RECV)
        zmq_msg_move(&held.msg, m)
        return held
    return PyBytes_FromStringAndSize(<char *>zmq_msg_data(m), <Py_ssize_t>size)


def recv(Py_ssize_t sock, Py_ssize_t big):
    """recv(sock, big): one whole message (see the module)."""
    cdef void *s = <void *>sock
    cdef list out = []
    cdef zmq_msg_t m
    cdef int e, more
    while True:
        zmq_msg_init(&m)
        if zmq_msg_recv(&m, s, ZMQ_DONTWAIT) < 0:
            e = zmq_errno()
            zmq_msg_close(&m)
            if not out:
                return None if e == EAGAIN else -e
            # A message's later frames are queued with its first: not seen to fail.
            _raise_errno(e)
        more = zmq_msg_more(&m)
        try:
            out.append(_take(&m, big))
        except BaseException:
            zmq_msg_close(&m)
            _drain(s, more)
            raise
        zmq_msg_close(&m)
        if not more:
            return out


def send(Py_ssize_t sock, frames, Py_ssize_t big):
    """send(sock, frames, big): 1 sent, 0 declined, -errno (see the module)."""
    cdef void *s = <void *>sock
    seq = PySequence_Fast(frames, "frames must be a sequence")
    cdef Py_ssize_t n = PySequence_Fast_GET_SIZE(seq)
    cdef PyObject **items = PySequence_Fast_ITEMS(seq)
    cdef Py_buffer views[MAX_FRAMES]
    cdef Py_ssize_t got = 0, i
    cdef int flags, e
    if n == 0 or n > MAX_FRAMES:
        return 0  # declined
    try:
        while got < n:
            if _get_buffer(<object>items[got], &views[got], PyBUF_SIMPLE) < 0:
                PyErr_Clear()
                return 0  # declined: not a contiguous buffer
            got += 1
            if views[got - 1].len >= big:
                return 0  # declined: pyzmq sends it its own way
        for i in range(n):
            flags = ZMQ_DONTWAIT | ZMQ_SNDMORE if i < n - 1 else ZMQ_DONTWAIT
            if zmq_send(s, views[i].buf, <size_t>views[i].len, flags) < 0:
                e = zmq_errno()
                if i == 0:
                    return -e
                # A message's later frames go where its first went: not seen to fail.
                _raise_errno(e)
        return 1
    finally:
        for i in range(got):
            PyBuffer_Release(&views[i])


def events(Py_ssize_t sock):
    """events(sock): ZMQ_EVENTS, or -1."""
    cdef int ev = 0
    cdef size_t size = sizeof(ev)
    if zmq_getsockopt(<void *>sock, ZMQ_EVENTS, &ev, &size) != 0:
        ev = -1
    return ev


def bound():
    """bound() -> the file of the libzmq these calls run on (the dynamic linker's choice,
    read back with dladdr), or None where it cannot be told."""
    cdef Dl_info info
    if dladdr(<const void *>zmq_msg_send, &info) == 0 or info.dli_fname == NULL:
        return None
    return PyUnicode_DecodeFSDefault(info.dli_fname)
