# cython: language_level=3
"""Declarations of ``target/_io_core.pyx`` (the twin of ``TargetQueue.submit``/``_complete`` and
``Controller._check_rw``) for the transports that cimport it: the SQE layout, the one rule for
which commands the compiled paths serve, SQHD, the CQE and the counts."""

from cpython.ref cimport PyObject

from blockd._iostats cimport IoCounters
from target._file_io cimport FastNamespace


# The NVMe layout both transports read (the SQE's fields, the CQE's size) and the values they test,
# from protocol/ at import (_check_layouts checks the offsets against protocol/'s builders).
cdef Py_ssize_t _SQE_SIZE, _CQE_SIZE
cdef Py_ssize_t _O_OPC, _O_FLAGS, _O_CID, _O_NSID, _O_ADDR, _O_LEN, _O_SGL_ID, _O_SLBA, _O_NLB, _O_CONTROL
cdef int _READ, _WRITE, _FLUSH, _KIND_READ, _KIND_WRITE, _KIND_FLUSH, _PSDT_MASK, _PSDT_SGL, _SGL_IN_CAPSULE
cdef int _SGL_TRANSPORT, _FUA


ctypedef struct QueueShape:
    # What stays fixed of a connected I/O queue (TargetQueue's fields), taken once (bind_queue)
    # so that each command reads C fields, not the queue's attributes.
    unsigned int qid
    unsigned int sqsize
    Py_ssize_t pool
    bint sqhd_disabled
    Py_ssize_t inline_size
    unsigned int max_transfer  # the transport's MDTS in bytes


ctypedef struct RwCommand:
    # The SQE fields of a Read or Write, as TargetQueue.submit unpacks them (parse_rw).
    int opcode
    int flags
    int control
    unsigned int cid
    unsigned int nsid
    unsigned long long slba
    unsigned int nlb  # blocks (NLB + 1)
    PyObject* ns  # set by eligible: the namespace's FastNamespace (mirror_eligible: its MirrorLane),
                  # borrowed (take it at once)


cdef bint bind_queue(object queue, QueueShape* shape) except -1
cdef void parse_rw(const unsigned char* sqe, RwCommand* c) noexcept
cdef object eligible(RwCommand* c, unsigned int length, bint fua_ok, object ctrl, object queue, QueueShape* shape)
cdef object mirror_eligible(RwCommand* c, unsigned int length, object ctrl, object queue, QueueShape* shape)
cdef void write_cqe(unsigned char* p, unsigned int sqhd, unsigned int sqid, unsigned int cid) noexcept
cdef bint queue_ready(object queue, object ctrl, Py_ssize_t pool) except -1
cdef unsigned int next_sqhd(object queue, QueueShape* shape) except? 0xFFFFFFFF
cdef void count_io(IoCounters counters, FastNamespace ns, int kind, unsigned int length, long long start) noexcept
