# cython: language_level=3
"""What the compiled NVMe/RDMA path (``target/_rdma_fast.pyx``) shares with the NVMe/TCP one in
``target/_io_fast.pyx``: the C copies of the storage, the namespace and range check, the CQE,
SQHD and the per-command counting, so that both transports serve a command by one set of rules."""

from posix.types cimport off_t
from posix.unistd cimport pwrite

from blockd._iostats cimport IoCounters


# The NVMe layout both transports read (the SQE's fields, the CQE's size) and the values they test:
# defined in target/_io_fast.pyx from protocol/ at import (each module's _check_layouts checks the
# offsets it uses against protocol/'s builders), cimported by target/_rdma_fast.pyx.
cdef Py_ssize_t _SQE_SIZE, _CQE_SIZE
cdef Py_ssize_t _O_OPC, _O_FLAGS, _O_CID, _O_NSID, _O_ADDR, _O_LEN, _O_SLBA, _O_NLB, _O_CONTROL
cdef int _READ, _WRITE, _KIND_READ, _KIND_WRITE, _PSDT_MASK, _PSDT_SGL, _SGL_IN_CAPSULE, _FUA


cdef class FastFile:
    cdef public int fd
    cdef public unsigned long long size
    cdef public bint read_only


cdef class FastNamespace:
    cdef public FastFile file
    cdef public object backend
    cdef public int lba_shift
    cdef public IoCounters counters
    cdef public bint accessible


cdef inline Py_ssize_t _pwrite_all(int fd, const unsigned char* p, Py_ssize_t length, off_t offset) noexcept nogil:
    """Write ``length`` bytes at ``offset``; the bytes written before the first short or failed
    ``pwrite`` (``length`` when all went)."""
    cdef Py_ssize_t done = 0, n
    while done < length:
        n = pwrite(fd, p + done, length - done, offset + done)
        if n <= 0:
            break
        done += n
    return done


cdef FastNamespace served_namespace(object entry, unsigned long long slba, unsigned int nlb, unsigned int length)
cdef void write_cqe(unsigned char* p, unsigned int sqhd, unsigned int sqid, unsigned int cid) noexcept
cdef bint queue_ready(object queue, object ctrl, Py_ssize_t pool) except -1
cdef unsigned int next_sqhd(object queue, unsigned int sqsize, bint disabled) except? 0xFFFFFFFF
cdef void count_io(IoCounters counters, FastNamespace ns, int kind, unsigned int length, long long start) noexcept
