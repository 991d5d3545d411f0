# cython: language_level=3, boundscheck=False, wraparound=False
"""A small write's data, copied once, behind room for the NVMe/TCP command capsule's common
header and SQE: the one ``bytes`` the capsule is sent as (what :class:`initiator.tcp_host_io.TcpHostIo`
``submit`` joins in Python).

Why: a 4 KiB write through FUSE had its data copied twice in user space, out of the FUSE
request buffer (which the next request is read into) and again when the output batcher joined
the capsule's header and the data into one send. The first copy has to stay: the command keeps
its data until it completes (it is sent again after a reconnect; multipath sends it on another
path), and uvloop keeps what it is given until it is written. So the compiled FUSE loop copies a
write it sends itself into an :class:`InlineData` (``inline_data``), and the compiled host I/O
(``initiator/_tcp_host_io.pyx``) writes the capsule's header and SQE into the room in front and
sends the whole ``bytes``: one copy, one buffer, no join. Everything else sees the data alone,
through the buffer protocol (read-only), ``len`` and slicing, as any ``memoryview``: digests,
R2T-sized writes, RDMA, a parked or retried command and the Python paths read it as they read
any buffer, and the bytes on the wire are the ones they were.

The room is written only while nothing but this object holds the ``bytes`` (``_room``; its
refcount is 1: no batcher list, no transport, no buffer export of it): a retry whose first send
a transport still holds is framed as any buffer (the header and the data, joined), never by
writing over bytes already handed out. The ``bytes`` is filled before anything else can see it
and only its room is written after; nothing hashes it. No Python twin: the Python FUSE loop
copies into a ``bytearray`` as before, and the Python host I/O joins the header and the data;
``tests/core/test_tcp_host_differential.py`` compares the bytes sent.
"""

cimport cython
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport PyObject, _Py_REFCNT
from libc.string cimport memcpy

from protocol.nvme import SQE_SIZE
from protocol.tcp import COMMON_HEADER_SIZE

ROOM = COMMON_HEADER_SIZE + SQE_SIZE
"""Bytes in front of the data: a command capsule's common header and SQE (PDO of in-capsule
data without digests)."""
cdef Py_ssize_t _ROOM = ROOM
cdef Py_ssize_t _ONE = 1
cdef char* _FORMAT = "B"


@cython.final
cdef class InlineData:
    """``len(data)`` bytes of write data, read-only, copied from ``data`` (any buffer; the
    compiled FUSE loop makes them with ``inline_data`` from its request buffer)."""

    def __init__(self, data):
        cdef const unsigned char[::1] view = memoryview(data).cast("B")
        self.n = view.shape[0]
        self.buf = PyBytes_FromStringAndSize(NULL, _ROOM + self.n)
        if self.n:
            memcpy(PyBytes_AS_STRING(self.buf) + _ROOM, &view[0], self.n)

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        return memoryview(self)[key]

    def __getbuffer__(self, Py_buffer* view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("InlineData is read-only")
        view.buf = PyBytes_AS_STRING(self.buf) + _ROOM
        view.obj = self
        view.len = self.n
        view.readonly = 1
        view.itemsize = 1
        view.format = _FORMAT if flags & PyBUF_FORMAT else NULL
        view.ndim = 1
        view.shape = &self.n if flags & PyBUF_ND else NULL
        view.strides = &_ONE if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL

    cdef char* _room(self) noexcept:
        """The room in front of the data (``ROOM`` bytes; the ``bytes`` object's own start), or
        NULL while anything else holds the ``bytes`` (see the module docstring)."""
        if _Py_REFCNT(<PyObject*>self.buf) != 1:  # the object itself: no temporary reference
            return NULL
        return PyBytes_AS_STRING(self.buf)


cdef InlineData inline_data(const char* data, Py_ssize_t n):
    """``InlineData`` of the ``n`` bytes at ``data``, without a Python call."""
    cdef InlineData d = InlineData.__new__(InlineData)
    d.n = n
    d.buf = PyBytes_FromStringAndSize(NULL, _ROOM + n)
    memcpy(PyBytes_AS_STRING(d.buf) + _ROOM, data, n)
    return d
