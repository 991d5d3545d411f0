# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :meth:`target.queue.TargetQueue.submit` and ``_complete`` with
:meth:`target.controller.Controller._check_rw`: the target core's part of the compiled paths.

- :func:`parse_rw` reads a Read or Write SQE's fields, as ``submit`` unpacks them;
- :func:`eligible` is the one rule for whether a compiled transport may serve a command itself:
  both transports (``target/_tcp_io.pyx``, ``target/_rdma_fast.pyx``) ask it, after their own
  SGL checks (which say where the data is and how long it is). Anything it refuses goes to the
  Python queue *before anything happened*, so every status comes from the reference;
  ``tests/core/test_io_core.py`` holds it against the Python queue (every command it accepts, the
  queue completes with success);
- :func:`bind_queue` takes a connected queue's fixed fields into one C struct (:class:`QueueShape`);
- :func:`next_sqhd`, :func:`write_cqe` and :func:`count_io` are ``_complete``'s SQHD, CQE and
  counters.

The kernel keeps this split on its fast path too: ``tcp.c`` calls ``nvmet_req_init`` in
``core.c``, which calls the backend's parse (``io-cmd-file.c``).
"""

from libc.string cimport memcpy

from blockd._iostats cimport IoCounters, now_ns
from blockd._le cimport le16, le32, le64, st16
from target._file_io cimport FastFile, FastNamespace, served_namespace

from blockd.iostats import KIND_BY_OPCODE
from protocol.constants import CC_EN, CSTS_RDY, PSDT_SGL, IoOpcode, SglId
from protocol.layout import field_offset
from protocol.nvme import CQE, CQE_FAST, FLAGS_PSDT_FUSE_MASK, IO_COMMAND, RW_CONTROL_FUA, SQE_SIZE

# -- layouts, from protocol/ (declared in target/_io_core.pxd: the transports read them) ------------

_SQE_SIZE = SQE_SIZE
_O_OPC = field_offset(IO_COMMAND, "opcode")
_O_FLAGS = field_offset(IO_COMMAND, "flags")
_O_CID = field_offset(IO_COMMAND, "cid")
_O_NSID = field_offset(IO_COMMAND, "nsid")
_O_ADDR = field_offset(IO_COMMAND, "sgl_address")
_O_LEN = field_offset(IO_COMMAND, "sgl_length")
_O_SGL_ID = field_offset(IO_COMMAND, "sgl_id")
_O_SLBA = field_offset(IO_COMMAND, "slba")
_O_NLB = field_offset(IO_COMMAND, "nlb")
_O_CONTROL = field_offset(IO_COMMAND, "control")
_CQE_SIZE = CQE.sizeof()
cdef Py_ssize_t _R_SQHD = field_offset(CQE, "sqhd")
cdef Py_ssize_t _R_SQID = field_offset(CQE, "sqid")
cdef Py_ssize_t _R_CID = field_offset(CQE, "cid")
cdef bytes _CQE_TEMPLATE = CQE_FAST.pack(0, 0, 0, 0, 0, 0)  # success: dw0, dw1, status 0

_READ = IoOpcode.READ
_WRITE = IoOpcode.WRITE
_FLUSH = IoOpcode.FLUSH
_KIND_READ = KIND_BY_OPCODE[_READ]
_KIND_WRITE = KIND_BY_OPCODE[_WRITE]
_KIND_FLUSH = KIND_BY_OPCODE[_FLUSH]
_PSDT_MASK = FLAGS_PSDT_FUSE_MASK
_PSDT_SGL = PSDT_SGL
_SGL_IN_CAPSULE = SglId.DATA_BLOCK_OFFSET
_SGL_TRANSPORT = SglId.TRANSPORT_DATA_BLOCK
_FUA = RW_CONTROL_FUA
cdef int _CC_EN = CC_EN
cdef int _CSTS_RDY = CSTS_RDY


def _check_layouts():
    """The SQE fields read here and the CQE written here against ``protocol/``'s builders."""
    sample = dict(opcode=0x11, flags=0x22, cid=0x3344, nsid=0x55667788, sgl_address=0x0102030405060708,
                  sgl_length=0x0A0B0C0D, sgl_id=0x5A, slba=0x1112131415161718, nlb=0x2122, control=0x3132)
    sqe = IO_COMMAND.build(sample)
    cdef const unsigned char* q = <const unsigned char*><const char*>sqe
    got = (q[_O_OPC], q[_O_FLAGS], le16(q + _O_CID), le32(q + _O_NSID), le64(q + _O_ADDR),
           le32(q + _O_LEN), q[_O_SGL_ID], le64(q + _O_SLBA), le16(q + _O_NLB), le16(q + _O_CONTROL))
    cdef bytearray cqe = bytearray(_CQE_SIZE)
    write_cqe(<unsigned char*><char*>cqe, 0x0102, 0x0304, 0x0506)
    if (len(sqe) != _SQE_SIZE or got != tuple(sample.values())
            or bytes(cqe) != CQE_FAST.pack(0, 0, 0x0102, 0x0304, 0x0506, 0)):
        raise ImportError("protocol/'s SQE or CQE layout is not the one target/_io_core.pyx uses")


_check_layouts()


cdef bint bind_queue(object queue, QueueShape* shape) except -1:
    """Take a connected I/O queue's fixed fields (``TargetQueue``'s) into ``shape``; False for the
    admin queue or one not connected yet (nothing to serve). ``max_transfer`` is the transport's
    to set."""
    if queue is None or not queue.qid or queue.controller is None:
        return False
    shape.qid = queue.qid
    shape.sqsize = queue.sqsize
    shape.pool = queue.pool
    shape.sqhd_disabled = queue.sqhd_disabled
    shape.inline_size = queue.inline_size
    return True


cdef void parse_rw(const unsigned char* q, RwCommand* c) noexcept:
    """The fields of the SQE at ``q`` that :func:`eligible` and the transports read."""
    c.opcode = q[_O_OPC]
    c.flags = q[_O_FLAGS]
    c.control = le16(q + _O_CONTROL)
    c.cid = le16(q + _O_CID)
    c.nsid = le32(q + _O_NSID)
    c.slba = le64(q + _O_SLBA)
    c.nlb = le16(q + _O_NLB) + 1
    c.ns = NULL


cdef object eligible(RwCommand* c, unsigned int length, bint fua_ok, object ctrl, object queue, QueueShape* shape):
    """The namespace (``ctrl.io_namespaces[nsid]``) if the compiled path may serve this Read or
    Write of ``length`` data bytes itself, its :class:`FastNamespace` in ``c.ns``; else None and
    the Python queue takes it. The steady-state case of ``TargetQueue.submit`` and
    ``Controller._check_rw``, the only one served in C:

    - PSDT SGL, a Read or a Write (the transport checked the SGL's kind and gave its length);
    - a Write without FUA, unless the transport can sync it where it runs (``fua_ok``);
    - a length not 0 and within MDTS;
    - a namespace of the controller's view (only those accessible through this port), on a
      plain file served here (:func:`served_namespace`: the range inside it, the length its
      blocks say), writable for a Write;
    - the queue ready: not locked by authentication, a command-pool slot free, the controller
      enabled and ready (:func:`queue_ready`).

    ``c.ns`` is borrowed from the namespace: the caller takes it as a reference before anything
    else runs."""
    if (c.flags & _PSDT_MASK) != _PSDT_SGL:
        return None
    if c.opcode == _WRITE:
        if c.control & _FUA and not fua_ok:
            return None
    elif c.opcode != _READ:
        return None
    if length == 0 or length > shape.max_transfer:
        return None
    entry = ctrl.io_namespaces.get(c.nsid)
    if entry is None:
        return None
    cdef FastNamespace ns = served_namespace(entry, c.slba, c.nlb, length)
    if ns is None or (c.opcode == _WRITE and ns.file.read_only):
        return None
    if not queue_ready(queue, ctrl, shape.pool):
        return None
    c.ns = <PyObject*>ns
    return entry


cdef object mirror_eligible(RwCommand* c, unsigned int length, object ctrl, object queue, QueueShape* shape):
    """The namespace if the compiled path may hand this in-capsule Write of ``length`` bytes to
    a replicated namespace's compiled lane (``target/replication/_mirror_io.pyx``), its
    :class:`MirrorLane` in ``c.ns``; else None and the Python queue takes it. :func:`eligible`'s
    rule for a namespace whose backend is a ``ReplicatedBackend`` with a lane (a plain file as its
    local copy, the compiled plane): PSDT SGL, a Write without FUA (FUA goes to every copy through
    the Python mirror), a length not 0 and within MDTS, a namespace of the controller's view, the
    range inside its data area (``Namespace.blocks``, the metadata excluded) and the length its
    blocks say, writable, no host registered on it
    (``Namespace.reserved``: the lane is not withdrawn by ``fast.accessible``), the queue ready. The lane then decides whether the mirror's state lets
    it take the write now (it declines before anything happened otherwise)."""
    if (c.flags & _PSDT_MASK) != _PSDT_SGL or c.opcode != _WRITE or c.control & _FUA:
        return None
    if length == 0 or length > shape.max_transfer:
        return None
    entry = ctrl.io_namespaces.get(c.nsid)
    if entry is None or entry.reserved:  # a registrant: the queue checks the reservation (target/reservations.py)
        return None
    lane = getattr(entry.backend, "lane", None)
    if lane is None:
        return None
    cdef unsigned long long blocks = entry.blocks
    cdef int shift = entry.lba_shift
    if (c.slba >= blocks or c.nlb > blocks - c.slba or (<unsigned long long>c.nlb << shift) != length
            or entry.backend.read_only):
        return None
    if not queue_ready(queue, ctrl, shape.pool):
        return None
    c.ns = <PyObject*>lane
    return entry


def serves(bytes sqe, unsigned int length, bint fua_ok, ctrl, queue, unsigned int max_transfer):
    """:func:`eligible` for one SQE, from Python: the test's handle on the rule
    (``tests/core/test_io_core.py``); True when the compiled path would serve it."""
    cdef QueueShape shape
    cdef RwCommand c
    if len(sqe) != _SQE_SIZE or not bind_queue(queue, &shape):
        return False
    shape.max_transfer = max_transfer
    parse_rw(<const unsigned char*><const char*>sqe, &c)
    return eligible(&c, length, fua_ok, ctrl, queue, &shape) is not None


cdef void write_cqe(unsigned char* p, unsigned int sqhd, unsigned int sqid, unsigned int cid) noexcept:
    """A successful command's CQE (dw0, dw1 and status 0): the CapsuleResp's, and what NVMe/RDMA
    SENDs alone."""
    memcpy(p, <const char*>_CQE_TEMPLATE, _CQE_SIZE)
    st16(p + _R_SQHD, sqhd)
    st16(p + _R_SQID, sqid)
    st16(p + _R_CID, cid)


cdef bint queue_ready(object queue, object ctrl, Py_ssize_t pool) except -1:
    """Whether a queue may take a command on the compiled paths now: not locked by
    authentication, a free command-pool slot (``TargetQueue``'s ``in_flight < pool``), and its
    controller enabled and ready (CC.EN, CSTS.RDY); else the Python queue answers it."""
    return not (queue.locked or queue.in_flight >= pool or not (ctrl.cc & _CC_EN) or not (ctrl.csts & _CSTS_RDY))


cdef unsigned int next_sqhd(object queue, QueueShape* shape) except? 0xFFFFFFFF:
    """SQHD for this completion, as ``TargetQueue._complete`` advances it."""
    if not shape.sqsize or shape.sqhd_disabled:
        return queue.sqhd
    sqhd = (queue.sqhd + 1) % (shape.sqsize + 1)
    queue.sqhd = sqhd
    return sqhd


cdef void count_io(IoCounters counters, FastNamespace ns, int kind, unsigned int length, long long start) noexcept:
    """The host's (``counters``) and the namespace's counts of one command that succeeded, its
    latency from ``start`` (as ``TargetQueue._complete``)."""
    cdef long long elapsed = now_ns() - start
    counters._count(kind, length, elapsed)
    ns.counters._count(kind, length, elapsed)
