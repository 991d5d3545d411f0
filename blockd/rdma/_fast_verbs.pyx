# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The verbs data path as direct libibverbs calls: the compiled twin of :mod:`blockd.rdma._fast`.

Same classes, same methods, same results as the ctypes reference (``tests/rdma/test_fast_path.py``
runs both against one fake provider and compares every posted work request byte for byte and
every completion returned).  What changes is how the C functions are reached:

* ``ibv_post_send``, ``ibv_post_recv``, ``ibv_poll_cq``, ``ibv_req_notify_cq`` are static inline
  functions of ``<infiniband/verbs.h>`` that jump through ``qp->context->ops`` /
  ``cq->context->ops``: called here from C, as every compiled verbs program does, instead of
  through ctypes function objects (a ctypes call converts and checks every argument, ~1 µs).
* Work requests, SGEs and completions are the header's own structs, filled and read by field
  name: their sizes and offsets come from the compiler, not from ``struct`` formats
  (:data:`LAYOUT` exposes them so a test can hold the reference's formats to them).
* The WR and SGE arrays are allocated once per QP (``max_send``/``max_recv`` entries, the
  QP's capacity) and the completion array once per CQ; nothing is allocated per call but the
  :data:`~blockd.rdma._fast.Wc` tuples ``poll`` returns (what the transports consume).

The raw pointers come from :func:`blockd.rdma._fast.cq_pointers` / ``qp_pointers`` (one place
for the pyverbs pointer extraction and its cross-checks); ``PostError`` and ``Wc`` are the
reference's, so callers see one set of types whichever path runs.
"""

from libc.errno cimport EAGAIN, errno  # EWOULDBLOCK is EAGAIN on Linux
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport strerror

from cpython.object cimport PyTypeObject
from cpython.ref cimport Py_INCREF

from blockd.rdma._fast import PostError, Wc
from blockd.rdma._raw import LayoutError

cdef extern from "<infiniband/verbs.h>" nogil:
    struct ibv_context_ops:
        void *poll_cq
        void *req_notify_cq
        void *post_send
        void *post_recv

    struct ibv_context:
        ibv_context_ops ops

    struct ibv_comp_channel:
        ibv_context *context
        int fd

    struct ibv_cq:
        ibv_context *context
        ibv_comp_channel *channel

    struct ibv_qp:
        ibv_context *context
        uint32_t qp_num

    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    # only named through ibv_send_wr.wr (a union in the header): Cython emits field accesses
    struct _send_wr_rdma "ibv_send_wr_rdma_unused":
        uint64_t remote_addr
        uint32_t rkey

    union _send_wr_union "ibv_send_wr_union_unused":
        _send_wr_rdma rdma

    struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        unsigned int opcode  # enum ibv_wr_opcode
        unsigned int send_flags
        uint32_t invalidate_rkey  # an anonymous union with imm_data (the same 32 bits)
        _send_wr_union wr

    struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr *next
        ibv_sge *sg_list
        int num_sge

    struct ibv_wc:
        uint64_t wr_id
        unsigned int status  # enum ibv_wc_status
        unsigned int opcode  # enum ibv_wc_opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t imm_data  # an anonymous union with invalidated_rkey
        uint32_t qp_num
        uint32_t src_qp
        unsigned int wc_flags
        uint16_t pkey_index
        uint16_t slid
        uint8_t sl
        uint8_t dlid_path_bits

    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
    int ibv_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad_wr)
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)
    int ibv_get_cq_event(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context)
    void ibv_ack_cq_events(ibv_cq *cq, unsigned int nevents)

cdef extern from *:
    """
    #include <stddef.h>
    #define BLOCKD_OFF_POLL_CQ offsetof(struct ibv_context, ops.poll_cq)
    #define BLOCKD_OFF_REQ_NOTIFY_CQ offsetof(struct ibv_context, ops.req_notify_cq)
    #define BLOCKD_OFF_POST_SEND offsetof(struct ibv_context, ops.post_send)
    #define BLOCKD_OFF_POST_RECV offsetof(struct ibv_context, ops.post_recv)
    #define BLOCKD_OFF_CQ_CHANNEL offsetof(struct ibv_cq, channel)
    #define BLOCKD_OFF_QP_NUM offsetof(struct ibv_qp, qp_num)
    #define BLOCKD_OFF_CC_FD offsetof(struct ibv_comp_channel, fd)
    #define BLOCKD_OFF_IMM_DATA offsetof(struct ibv_send_wr, imm_data)
    #define BLOCKD_OFF_REMOTE_ADDR offsetof(struct ibv_send_wr, wr.rdma.remote_addr)
    #define BLOCKD_OFF_RKEY offsetof(struct ibv_send_wr, wr.rdma.rkey)
    """
    const size_t OFF_POLL_CQ "BLOCKD_OFF_POLL_CQ"
    const size_t OFF_REQ_NOTIFY_CQ "BLOCKD_OFF_REQ_NOTIFY_CQ"
    const size_t OFF_POST_SEND "BLOCKD_OFF_POST_SEND"
    const size_t OFF_POST_RECV "BLOCKD_OFF_POST_RECV"
    const size_t OFF_CQ_CHANNEL "BLOCKD_OFF_CQ_CHANNEL"
    const size_t OFF_QP_NUM "BLOCKD_OFF_QP_NUM"
    const size_t OFF_CC_FD "BLOCKD_OFF_CC_FD"
    const size_t OFF_IMM_DATA "BLOCKD_OFF_IMM_DATA"
    const size_t OFF_REMOTE_ADDR "BLOCKD_OFF_REMOTE_ADDR"
    const size_t OFF_RKEY "BLOCKD_OFF_RKEY"

cdef enum:
    _BATCH = 64  # completions per ibv_poll_cq call (the reference's FastCQ.BATCH)
    _ACK_EVERY = 64  # events taken before they are acknowledged

LAYOUT = {
    "ibv_wc": sizeof(ibv_wc), "ibv_send_wr": sizeof(ibv_send_wr),
    "ibv_recv_wr": sizeof(ibv_recv_wr), "ibv_sge": sizeof(ibv_sge),
    "ibv_context.ops.poll_cq": OFF_POLL_CQ, "ibv_context.ops.req_notify_cq": OFF_REQ_NOTIFY_CQ,
    "ibv_context.ops.post_send": OFF_POST_SEND, "ibv_context.ops.post_recv": OFF_POST_RECV,
    "ibv_cq.channel": OFF_CQ_CHANNEL, "ibv_qp.qp_num": OFF_QP_NUM,
    "ibv_comp_channel.fd": OFF_CC_FD, "ibv_send_wr.imm_data": OFF_IMM_DATA,
    "ibv_send_wr.wr.rdma.remote_addr": OFF_REMOTE_ADDR, "ibv_send_wr.wr.rdma.rkey": OFF_RKEY,
}
"""Sizes and offsets of the structures used here, as the C compiler laid them out."""

cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject *type, Py_ssize_t nitems)
    void PyTuple_SET_ITEM(object p, Py_ssize_t pos, object o)

cdef PyTypeObject *_WC_TYPE = <PyTypeObject *>Wc
if (<type>Wc).__base__ is not tuple or (<type>Wc).__basicsize__ != tuple.__basicsize__:
    raise ImportError("blockd.rdma._fast.Wc is not a plain tuple subclass")


cdef inline void _put(object t, Py_ssize_t i, object v):
    Py_INCREF(v)  # PyTuple_SET_ITEM steals a reference
    PyTuple_SET_ITEM(t, i, v)


cdef object _wc(ibv_wc *w):
    """A Wc as ``tuple.__new__(Wc, ...)`` makes it (tp_alloc, then the items), without the
    argument tuples and the call."""
    t = PyType_GenericAlloc(_WC_TYPE, 13)
    _put(t, 0, w.wr_id)
    _put(t, 1, w.status)
    _put(t, 2, w.opcode)
    _put(t, 3, w.vendor_err)
    _put(t, 4, w.byte_len)
    _put(t, 5, w.imm_data)
    _put(t, 6, w.qp_num)
    _put(t, 7, w.src_qp)
    _put(t, 8, w.wc_flags)
    _put(t, 9, w.pkey_index)
    _put(t, 10, w.slid)
    _put(t, 11, w.sl)
    _put(t, 12, w.dlid_path_bits)
    return t


cdef inline str _rc_text(int rc):
    return strerror(rc).decode() if rc > 0 else str(rc)


cdef class FastCQ:
    """Poll / arm / event handling of one CQ with its completion channel (raw pointers from
    :func:`blockd.rdma._fast.cq_pointers`)."""

    BATCH = _BATCH
    ACK_EVERY = _ACK_EVERY

    cdef ibv_cq *cq
    cdef ibv_comp_channel *cc
    cdef ibv_wc *wc
    cdef readonly uintptr_t cq_ptr
    cdef readonly uintptr_t cc_ptr
    cdef public unsigned int unacked

    def __cinit__(self, uintptr_t cq_ptr, uintptr_t cc_ptr, uintptr_t ctx_ptr):
        cdef ibv_context *ctx = <ibv_context *>ctx_ptr
        if ctx.ops.poll_cq == NULL or ctx.ops.req_notify_cq == NULL:
            raise LayoutError("ibv_context ops slot poll_cq or req_notify_cq is NULL")
        self.cq = <ibv_cq *>cq_ptr
        self.cc = <ibv_comp_channel *>cc_ptr
        self.cq_ptr = cq_ptr
        self.cc_ptr = cc_ptr
        self.wc = <ibv_wc *>calloc(_BATCH, sizeof(ibv_wc))
        if self.wc == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.wc)

    def get_event(self) -> bool:
        """Take one event off the (non-blocking) channel; False when there was none (see the
        reference for why one is all there can be)."""
        cdef ibv_cq *ev_cq = NULL
        cdef void *ev_ctx = NULL
        cdef int err
        if ibv_get_cq_event(self.cc, &ev_cq, &ev_ctx) == 0:
            if ev_cq != self.cq:
                raise OSError(22, "completion event for another CQ")
            self.unacked += 1
            if self.unacked >= _ACK_EVERY:
                self.ack()
            return True
        err = errno
        if err != EAGAIN:
            raise OSError(err, f"ibv_get_cq_event: {_rc_text(err)}")
        return False

    def get_events(self) -> int:
        """Take every pending event off the channel; how many there were."""
        cdef int n = 0
        while self.get_event():
            n += 1
        return n

    def ack(self) -> None:
        """Acknowledge the events taken so far (ibv_destroy_cq waits for every one)."""
        if self.unacked:
            ibv_ack_cq_events(self.cq, self.unacked)
            self.unacked = 0

    def req_notify(self) -> None:
        cdef int rc = ibv_req_notify_cq(self.cq, 0)
        if rc:
            raise OSError(rc, f"ibv_req_notify_cq: {_rc_text(rc)}")

    def poll(self, int batch=64) -> list:
        """Every completion now in the CQ, as :data:`~blockd.rdma._fast.Wc` tuples."""
        cdef int n, k
        cdef list out = []
        if batch > _BATCH:
            batch = _BATCH
        while True:
            n = ibv_poll_cq(self.cq, batch, self.wc)
            if n < 0:
                raise OSError(-n, "ibv_poll_cq failed")
            for k in range(n):
                out.append(_wc(&self.wc[k]))
            if n < batch:
                return out


cdef class FastQP:
    """Chained posting of send and receive WRs on one QP from preallocated memory (raw pointers
    from :func:`blockd.rdma._fast.qp_pointers`)."""

    cdef ibv_qp *qp
    cdef ibv_send_wr *swr
    cdef ibv_sge *ssge
    cdef ibv_recv_wr *rwr
    cdef ibv_sge *rsge
    cdef readonly uintptr_t qp_ptr
    cdef readonly int max_send
    cdef readonly int max_recv

    def __cinit__(self, uintptr_t qp_ptr, uintptr_t ctx_ptr, int max_send, int max_recv):
        cdef ibv_context *ctx = <ibv_context *>ctx_ptr
        if ctx.ops.post_send == NULL or ctx.ops.post_recv == NULL:
            raise LayoutError("ibv_context ops slot post_send or post_recv is NULL")
        self.qp = <ibv_qp *>qp_ptr
        self.qp_ptr = qp_ptr
        self.max_send = max(1, max_send)
        self.max_recv = max(1, max_recv)
        self.swr = <ibv_send_wr *>calloc(self.max_send, sizeof(ibv_send_wr))
        self.ssge = <ibv_sge *>calloc(self.max_send, sizeof(ibv_sge))
        self.rwr = <ibv_recv_wr *>calloc(self.max_recv, sizeof(ibv_recv_wr))
        self.rsge = <ibv_sge *>calloc(self.max_recv, sizeof(ibv_sge))
        if self.swr == NULL or self.ssge == NULL or self.rwr == NULL or self.rsge == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.swr)
        free(self.ssge)
        free(self.rwr)
        free(self.rsge)

    def post_send(self, wrs) -> None:
        """Post ``(wr_id, opcode, send_flags, addr, length, lkey, imm_or_inv, raddr, rkey)`` WRs
        as chains (one SGE each; ``length`` 0 means no SGE); raises
        :class:`~blockd.rdma._fast.PostError`."""
        cdef Py_ssize_t i = 0, n = len(wrs), m, k
        cdef ibv_send_wr *w
        cdef ibv_sge *s
        cdef ibv_send_wr *bad = NULL
        cdef int rc
        while i < n:
            m = n - i
            if m > self.max_send:
                m = self.max_send
            for k in range(m):
                t = wrs[i + k]
                w = &self.swr[k]
                s = &self.ssge[k]
                w.wr_id, w.opcode, w.send_flags, s.addr, s.length, s.lkey, w.invalidate_rkey, \
                    w.wr.rdma.remote_addr, w.wr.rdma.rkey = t
                w.next = &self.swr[k + 1] if k + 1 < m else NULL
                if s.length:
                    w.sg_list = s
                    w.num_sge = 1
                else:
                    w.sg_list = NULL
                    w.num_sge = 0
            bad = NULL
            rc = ibv_post_send(self.qp, self.swr, &bad)
            if rc:
                k = bad - self.swr if bad != NULL and bad >= self.swr and bad < self.swr + m else 0
                raise PostError(rc, "ibv_post_send", i + k)
            i += m

    def post_recv(self, wrs) -> None:
        """Post ``(wr_id, addr, length, lkey)`` receives as chains; raises
        :class:`~blockd.rdma._fast.PostError`."""
        cdef Py_ssize_t i = 0, n = len(wrs), m, k
        cdef ibv_recv_wr *w
        cdef ibv_sge *s
        cdef ibv_recv_wr *bad = NULL
        cdef int rc
        while i < n:
            m = n - i
            if m > self.max_recv:
                m = self.max_recv
            for k in range(m):
                t = wrs[i + k]
                w = &self.rwr[k]
                s = &self.rsge[k]
                w.wr_id, s.addr, s.length, s.lkey = t
                w.next = &self.rwr[k + 1] if k + 1 < m else NULL
                w.sg_list = s
                w.num_sge = 1
            bad = NULL
            rc = ibv_post_recv(self.qp, self.rwr, &bad)
            if rc:
                k = bad - self.rwr if bad != NULL and bad >= self.rwr and bad < self.rwr + m else 0
                raise PostError(rc, "ibv_post_recv", i + k)
            i += m
