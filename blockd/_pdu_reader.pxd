# cython: language_level=3
"""The compiled PDU reader's C declarations, for the modules that drive it from C.

``target/_tcp_io.pyx`` runs the target's receive loop in C: it asks :meth:`PduReader.whole`
whether the next PDU is a whole command capsule in staging, serves it from there and
:meth:`PduReader.skip` s it, and takes every other PDU with :meth:`PduReader.take`, the step of
the reader's own ``buffer_updated`` generator.
"""


cdef class PduReader:
    cdef public object place
    cdef public Py_ssize_t max_data
    cdef public Py_ssize_t completed
    cdef public Py_ssize_t copied
    cdef public bint hdgst
    cdef public bint ddgst
    cdef public int stage_type
    cdef public Py_ssize_t stage_limit
    cdef object _accepted
    cdef object _allowed
    cdef unsigned char _accepted_t[256]
    cdef unsigned char _allowed_t[256]
    cdef readonly object _buf  # read by a test: staging must not grow for placed data
    cdef object _view
    cdef unsigned char* _p
    cdef Py_ssize_t _size
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef Py_ssize_t _need
    cdef Py_ssize_t _min_free
    # the data PDU being received into the buffer ``place`` gave (``_pl_dest`` not None)
    cdef object _pl_dest
    cdef bytes _pl_header
    cdef int _pl_type
    cdef int _pl_flags
    cdef Py_ssize_t _pl_len
    cdef Py_ssize_t _pl_filled
    cdef bint _pl_digest

    cdef int _set_buffer(self, buf) except -1
    cpdef object get_buffer(self, Py_ssize_t sizehint=*)
    cdef void _make_room(self) except *
    cdef int _regrow(self, Py_ssize_t size) except -1
    cdef bint advance(self, Py_ssize_t nbytes) noexcept
    cdef object take(self)
    cdef Py_ssize_t whole(self, int ptype) noexcept
    cdef void skip(self, Py_ssize_t plen) noexcept
    cdef object _finish_placement(self)
    cdef object _next(self)
    cdef bint _stages(self, int ptype, Py_ssize_t pos, Py_ssize_t plen, Py_ssize_t data_len) noexcept
    cdef object _refused(self, int fes, int fei, str message)
    cdef object _place(self, int ptype, int flags, header, Py_ssize_t header_end, Py_ssize_t data_len,
                       int dd, dest)
