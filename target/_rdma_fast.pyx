# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The RDMA target's compiled per-command path: a steady-state Read, or Write with its data in the
capsule, served inside the completion handler, without a :class:`target.request.Request` or a
``RdmaCommand``.

:class:`RdmaFastPath` is the CQ callback of one :class:`target.rdma.RdmaTargetConnection` (in
place of its ``_completions``) and takes each completion of a batch first:

* a receive that holds a Read the compiled path can serve (below) is served here: ``pread``
  straight into a registered data slot, its CQE written into a response slot, and the RDMA WRITE
  of the data chained with the response SEND (SEND_WITH_INV of the command's key when the SGL
  asks for it) and the receive's re-post queued in the connection's batch lists
  (``send_out``/``recv_out``), which go out as one chain each at the batch's end, exactly as
  ``RdmaTargetConnection.pump_responses`` queues them; a Write with its data in the capsule (as
  the kernel host sends up to the 4 KiB in-capsule size) is written from the receive buffer and
  answered with the SEND alone; a Write whose data the host holds (keyed SGL: every kernel-host
  write above 4 KiB) takes a data slot and is queued for its RDMA READs as
  ``TargetQueue.submit`` and ``fetch_data`` queue one (:class:`FastWrite`); the connection posts
  them by its own ``pump_reads`` (READ_CHUNK pieces, ``READ_BYTES_IN_FLIGHT``, the initiator
  depth, one FIFO line with the Python path's writes), and on the last READ's completion
  (``_read_done`` asks :meth:`RdmaFastPath.data_ready` first) it is written from the slot and
  answered with the SEND;
* the SEND completion of a command served here gives back its response and data slots and its
  command-pool place (``queue.in_flight``), as ``_send_done`` and ``TargetQueue.response_sent``
  do for the Python path's;
* every other completion goes to ``RdmaTargetConnection.completion``, the Python path, as
  before.

The Read served here is the steady-state case: an I/O queue of a ready controller that is not
waiting for authentication, the command pool not full (``queue.in_flight < queue.pool``), the
daemon not over ``max_unsent_total`` (the connection not deferring), no response waiting for a
response slot and one free, PSDT SGL; for a Read a keyed SGL (Keyed Data Block, plain or
invalidating, as the kernel host sends), for a Write a Data Block at offset 0 within the queue's
in-capsule size and the data received, or a keyed SGL with the host offering RDMA READ
(initiator depth > 0) and a data slot free now, no FUA, a writable namespace; the length not 0 and within
MDTS, a namespace whose backend is a plain
:class:`target.backend.FileBackend` (``eligible`` of ``target/_io_core.pxd``, the rule
the NVMe/TCP path uses), the range inside it and the length its blocks say, a registered data
slot free now for a Read, and a ``pread`` or ``pwrite`` that moves it all (one that fails is
run again by the Python path, which reports the error). Anything else returns to the Python path
*before anything happened*, so every status and error-log entry stays the Python reference's.
What the Python path does for such a Read and this one does at the same points: SQHD (modulo
SQSIZE + 1, unless the host disabled SQ flow control), the host's and the namespace's counters
(latency from the receive's handling to the response queued), the keep-alive stamp
(``controller.traffic_seen``), the command pool from the receive to the SEND's completion; the
namespace hold (``ns.in_flight``) is taken and released within the call, so it is not touched.

A command served here stands in the connection's ``resp_cmd`` as its data slot (False for a
write, which has none; the Python path's commands are ``RdmaCommand`` objects there), which is how its
SEND completion is told apart and how the connection's teardown finds its slot (a write by
RDMA READ stands there as its data slot too). While its READs run, a write by RDMA READ is a
``RdmaCommand`` in ``conn.cmds`` like the Python path's, its ``req`` a :class:`FastWrite`; what goes
wrong from there (a READ that fails or cannot be posted, the queue lost, the namespace changed,
a ``pwrite`` that fails, no response slot free at the end) is ended by the Python queue with the
request it would have made (``TargetQueue.adopt_write``), so its status and error-log entry are
the reference's.

Measured (``tests/bench/bench_rdma_target.py --callgrind``, in process, target side; docs/dataplane.md):
a 4 KiB QD1 read 93 k instructions per command on the Python path, 33 k here; a 4 KiB in-capsule
write 79 k, 26 k. In the VM bed the target's user time per 4 KiB read fell 2–4×.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uintptr_t
from posix.types cimport off_t
from posix.unistd cimport pread

from blockd._iostats cimport IoCounters, now_ns
from blockd._le cimport le16, le32, le64
from target._file_io cimport FastFile, FastNamespace, _pwrite_all
from target._io_core cimport (
    _CQE_SIZE, _KIND_READ, _KIND_WRITE, _O_ADDR, _O_CID, _O_CONTROL, _O_FLAGS, _O_LEN, _O_NLB, _O_NSID, _O_OPC, _O_SLBA,
    _READ, _SGL_IN_CAPSULE, _SQE_SIZE, _WRITE, QueueShape, RwCommand, bind_queue, count_io, eligible, next_sqhd,
    parse_rw, write_cqe,
)

from blockd.rdma.abi import SEND_SIGNALED, WR_RDMA_WRITE, WR_SEND, WR_SEND_WITH_INV
from protocol.constants import SglId
from protocol.layout import field_offset
from protocol.nvme import CQE_FAST, SGL1_OFFSET, SGL_KEYED, build_sgl_data_block, build_sgl_keyed, build_sqe

# -- layouts, from protocol/ (the SQE's fields and the CQE's size: target/_io_core.pxd) -----------

cdef Py_ssize_t _K_ADDR = SGL1_OFFSET + field_offset(SGL_KEYED, "address")
cdef Py_ssize_t _K_LEN = SGL1_OFFSET + field_offset(SGL_KEYED, "length")  # 24 bits
cdef Py_ssize_t _K_KEY = SGL1_OFFSET + field_offset(SGL_KEYED, "key")
cdef Py_ssize_t _K_ID = SGL1_OFFSET + field_offset(SGL_KEYED, "sgl_id")

cdef int _KEYED = SglId.KEYED_DATA_BLOCK
cdef int _KEYED_INVALIDATE = SglId.KEYED_DATA_BLOCK_INVALIDATE
cdef int _WR_RDMA_WRITE = WR_RDMA_WRITE
cdef int _WR_SEND = WR_SEND
cdef int _WR_SEND_WITH_INV = WR_SEND_WITH_INV
cdef int _SIGNALED = SEND_SIGNALED


cdef inline unsigned int _le24(const unsigned char* p) noexcept:
    return p[0] | (p[1] << 8) | (p[2] << 16)


def _check_layouts():
    """The SQE and keyed SGL fields read here and the CQE written here against ``protocol/``."""
    sqe = build_sqe(0x11, 0x3344, flags=0x22, nsid=0x55667788, cdw10=0x15161718, cdw11=0x11121314,
                    cdw12=0x2122, dptr=build_sgl_keyed(0x0102030405060708, 0x0A0B0C, 0x0D0E0F10, 0x4F))
    cdef const unsigned char* q = <const unsigned char*><const char*>sqe
    got = (q[_O_OPC], q[_O_FLAGS], le16(q + _O_CID), le32(q + _O_NSID), le64(q + _O_SLBA), le16(q + _O_NLB),
           le64(q + _K_ADDR), _le24(q + _K_LEN), le32(q + _K_KEY), q[_K_ID])
    block = build_sqe(0x11, 0x3344, cdw12=0x3132 << 16, dptr=build_sgl_data_block(0x01, 0x0102030405060708, 0x0A0B0C0D))
    q = <const unsigned char*><const char*>block
    got += (le16(q + _O_CONTROL), le64(q + _O_ADDR), le32(q + _O_LEN), q[_K_ID])
    cdef bytearray cqe = bytearray(_CQE_SIZE)
    write_cqe(<unsigned char*><char*>cqe, 0x0102, 0x0304, 0x0506)
    if (len(sqe) != _SQE_SIZE or got != (0x11, 0x22, 0x3344, 0x55667788, 0x1112131415161718, 0x2122,
                                         0x0102030405060708, 0x0A0B0C, 0x0D0E0F10, 0x4F,
                                         0x3132, 0x0102030405060708, 0x0A0B0C0D, 0x01)
            or bytes(cqe) != CQE_FAST.pack(0, 0, 0x0102, 0x0304, 0x0506, 0)):
        raise ImportError("protocol/'s SQE, SGL or CQE layout is not the one target/_rdma_fast.pyx uses")


_check_layouts()


cdef class FastWrite:
    """A Write the compiled path took whose data comes by RDMA READ, in its ``RdmaCommand``'s ``req``
    in place of a :class:`target.request.Request` while the READs run: the connection's
    ``pump_reads`` and ``_read_done`` read ``length``, ``sgl_address`` and ``sgl_key`` of it as
    of a request; the ends left to Python (a READ that fails or cannot be posted, the
    connection lost, a ``pwrite`` that fails) get the request the queue would have made
    (:meth:`RdmaFastPath.request`, ``TargetQueue.adopt_write``)."""

    cdef readonly unsigned int cid
    cdef readonly unsigned int length
    cdef readonly unsigned long long sgl_address
    cdef readonly unsigned int sgl_key
    cdef int sgl_id
    cdef bytes sqe
    cdef long long start_ns
    cdef object nsobj
    cdef FastNamespace ns
    cdef off_t offset


cdef class RdmaFastPath:
    """The completion handling of one NVMe/RDMA queue, steady-state Reads in C (module docstring)."""

    cdef object conn
    cdef object queue
    cdef object ctrl
    cdef IoCounters counters
    cdef object data
    cdef object resp_pool
    cdef list resp_slots
    cdef list resp_cmd
    cdef list recv_wrs
    cdef list send_out
    cdef list recv_out
    cdef object resp_wait
    cdef object cmd_type
    cdef uintptr_t recv_base
    cdef Py_ssize_t recv_size
    cdef Py_ssize_t recv_count
    cdef unsigned long long resp_lkey
    cdef int kind_shift
    cdef unsigned long long mask
    cdef unsigned long long recv_kind
    cdef unsigned long long send_kind
    cdef unsigned long long write_kind
    cdef bint _bound
    cdef bint _off
    cdef QueueShape shape
    """The queue's fixed fields, taken when it binds (``target/_io_core.pxd``)."""
    cdef public unsigned long long served
    """Commands taken here (the tests check that the compiled path ran)."""
    cdef public unsigned long long fetched
    """Writes by RDMA READ written and answered here."""

    def __init__(self, conn):
        from target import rdma  # not at import: target.rdma imports this module (target.io_fast)
        self.conn = conn
        self.data = conn.data
        self.resp_pool = conn.resp_pool
        self.resp_slots = list(conn.resp_pool.slots)
        self.resp_lkey = conn.resp_pool.lkey
        self.resp_cmd = conn.resp_cmd
        self.recv_wrs = conn.recv_wrs
        self.send_out = conn.send_out
        self.recv_out = conn.recv_out
        self.resp_wait = conn.resp_wait
        self.cmd_type = rdma.RdmaCommand
        recv = conn.recv_pool
        self.recv_base = recv.base  # the receive slots lie side by side in one buffer
        self.recv_size = recv.slot_size
        self.recv_count = recv.count
        self.kind_shift = rdma.KIND_SHIFT
        self.mask = rdma.WR_ID_MASK
        self.recv_kind = rdma.KIND_RECV
        self.send_kind = rdma.KIND_SEND
        self.write_kind = rdma.KIND_WRITE
        self.shape.max_transfer = conn.info.max_transfer
        self.served = 0
        self.fetched = 0

    def completions(self, list wcs):
        """The CQ's callback: one batch of completions (``RdmaTargetConnection._completions``
        with the steady-state ones served here)."""
        conn = self.conn
        conn.batching = True
        try:
            for wc in wcs:
                try:
                    if self._completion(<tuple>wc):
                        continue
                except Exception as exc:  # as the Python path: never let one completion stall the rest
                    conn.handling_failed(exc)
                    continue
                conn.completion(wc)
        finally:
            conn.batching = False
            if self.send_out or self.recv_out:
                conn.flush()

    cdef bint _completion(self, tuple wc) except -1:
        """Handled here, or False with nothing done."""
        cdef unsigned long long wr_id = wc[0]
        cdef unsigned int status = wc[1]
        cdef unsigned long long kind = wr_id >> self.kind_shift
        cdef Py_ssize_t idx = <Py_ssize_t>(wr_id & self.mask)
        if kind == self.send_kind:
            return self._sent(idx, status)
        if kind == self.recv_kind and not status:
            return self._command(idx, wc[4])
        return False

    cdef bint _bind(self) except -1:
        """Once the queue is a connected I/O queue: take what stays fixed from then on."""
        queue = self.conn.queue
        if queue.controller is None:
            return False  # not connected yet
        if not queue.qid:
            self._off = True  # the admin queue: nothing to serve
            return False
        bind_queue(queue, &self.shape)
        self._bound = True
        self.queue = queue
        self.ctrl = queue.controller
        self.counters = queue.counters
        return True

    cdef bint _command(self, Py_ssize_t idx, Py_ssize_t nbytes) except -1:
        cdef long long start = now_ns()
        conn = self.conn
        if self._off or idx >= self.recv_count or nbytes < _SQE_SIZE or conn.closing or conn.deferring:
            return False
        if not self._bound and not self._bind():
            return False
        cdef const unsigned char* q = <const unsigned char*>(self.recv_base + <uintptr_t>(idx * self.recv_size))
        cdef RwCommand c
        cdef int sgl_id = q[_K_ID]
        cdef unsigned int length
        parse_rw(q, &c)
        # the transport's part: where the data is (a keyed SGL: the host's memory, by RDMA WRITE
        # or READ; a Write's Data Block at offset 0: in the capsule, within the in-capsule size)
        if sgl_id == _KEYED or sgl_id == _KEYED_INVALIDATE:
            length = _le24(q + _K_LEN)
        elif c.opcode == _WRITE and sgl_id == _SGL_IN_CAPSULE and le64(q + _O_ADDR) == 0:
            length = le32(q + _O_LEN)
            if length > nbytes - _SQE_SIZE or length > self.shape.inline_size:
                return False
        else:
            return False
        # the core's part: the one rule both transports ask (target/_io_core.pyx); no FUA here
        entry = eligible(&c, length, False, self.ctrl, self.queue, &self.shape)
        if entry is None or self.resp_wait or not self.resp_pool.available:
            return False
        cdef FastNamespace ns = <FastNamespace><object>c.ns
        cdef int opcode = c.opcode
        cdef unsigned long long slba = c.slba
        queue = self.queue
        ctrl = self.ctrl
        if opcode == _WRITE:
            if sgl_id == _SGL_IN_CAPSULE:
                return self._write(ns, idx, q, length, slba, start)
            return self._fetch(entry, ns, idx, q, length, slba, sgl_id, start)
        slot = self.data.get_now(length)
        if slot is None:
            return False  # the Python path reads into memory and waits for a slot
        cdef uintptr_t addr = slot.addr
        cdef int fd = ns.file.fd
        cdef off_t offset = <off_t>(slba << ns.lba_shift)
        cdef Py_ssize_t got
        with nogil:
            got = pread(fd, <void*>addr, length, offset)
        if got != length:
            self.data.put(slot)
            return False  # the Python path reads again and reports the error
        # TargetQueue.submit and _complete, then RdmaTargetConnection.pump_responses
        queue.in_flight += 1
        ctrl.traffic_seen = True
        rslot = self.resp_pool.get()
        cdef Py_ssize_t i = rslot.index
        cdef uintptr_t raddr = rslot.addr
        write_cqe(<unsigned char*>raddr, next_sqhd(queue, &self.shape), self.shape.qid, c.cid)
        count_io(self.counters, ns, _KIND_READ, length, start)
        self.resp_cmd[i] = slot
        cdef unsigned int key = le32(q + _K_KEY)
        self.send_out.append(((self.write_kind << self.kind_shift) | i, _WR_RDMA_WRITE, 0, addr, length, slot.lkey,
                              0, le64(q + _K_ADDR), key))
        if sgl_id == _KEYED_INVALIDATE:
            self.send_out.append(((self.send_kind << self.kind_shift) | i, _WR_SEND_WITH_INV, _SIGNALED, raddr,
                                  _CQE_SIZE, self.resp_lkey, key, 0, 0))
        else:
            self.send_out.append(((self.send_kind << self.kind_shift) | i, _WR_SEND, _SIGNALED, raddr, _CQE_SIZE,
                                  self.resp_lkey, 0, 0, 0))
        self.recv_out.append(self.recv_wrs[idx])  # before the response: the host may reuse it at once
        self.served += 1
        return True

    cdef bint _write(self, FastNamespace ns, Py_ssize_t idx, const unsigned char* q, unsigned int length,
                     unsigned long long slba, long long start) except -1:
        """An in-capsule Write: written from the receive buffer, then the response SEND alone."""
        cdef int fd = ns.file.fd
        cdef off_t offset = <off_t>(slba << ns.lba_shift)
        cdef Py_ssize_t done
        with nogil:
            done = _pwrite_all(fd, q + _SQE_SIZE, length, offset)
        if done != length:
            return False  # the Python path writes again and reports the error
        self.queue.in_flight += 1
        self.ctrl.traffic_seen = True
        rslot = self.resp_pool.get()
        cdef Py_ssize_t i = rslot.index
        cdef uintptr_t raddr = rslot.addr
        write_cqe(<unsigned char*>raddr, next_sqhd(self.queue, &self.shape), self.shape.qid,
                  le16(q + _O_CID))
        count_io(self.counters, ns, _KIND_WRITE, length, start)
        self.resp_cmd[i] = False  # served here, no data slot
        self.send_out.append(((self.send_kind << self.kind_shift) | i, _WR_SEND, _SIGNALED, raddr, _CQE_SIZE,
                              self.resp_lkey, 0, 0, 0))
        self.recv_out.append(self.recv_wrs[idx])
        self.served += 1
        return True

    cdef bint _fetch(self, entry, FastNamespace ns, Py_ssize_t idx, const unsigned char* q, unsigned int length,
                     unsigned long long slba, int sgl_id, long long start) except -1:
        """A Write whose data the host holds (keyed SGL): its :class:`FastWrite` in a ``RdmaCommand``
        with a data slot free now, queued for its RDMA READs as ``TargetQueue.submit`` and
        ``RdmaTargetConnection.fetch_data``/``_read_slot`` queue one, and the connection's own
        ``pump_reads`` posts them (so READ_CHUNK, ``READ_BYTES_IN_FLIGHT``, the initiator depth
        and the FIFO order are the Python path's, not a copy of them); :meth:`data_ready` writes
        and answers it. What the queue holds for it until ``response_sent`` is taken here: the
        pool slot (``queue.in_flight``) and the namespace (``ns.in_flight``, as ``_check_rw``:
        a removed namespace keeps its file until the write is done)."""
        conn = self.conn
        if conn.cm.initiator_depth == 0:
            return False  # no RDMA READ service: the Python path's status
        slot = self.data.get_now(length)
        if slot is None:
            return False  # the Python path waits for a slot in line
        cdef FastWrite w = FastWrite.__new__(FastWrite)
        w.cid = le16(q + _O_CID)
        w.length = length
        w.sgl_address = le64(q + _K_ADDR)
        w.sgl_key = le32(q + _K_KEY)
        w.sgl_id = sgl_id
        w.sqe = PyBytes_FromStringAndSize(<const char*>q, _SQE_SIZE)
        w.start_ns = start
        w.nsobj = entry
        w.ns = ns
        w.offset = <off_t>(slba << ns.lba_shift)
        cmd = self.cmd_type(idx)
        cmd.req = w
        cmd.data = slot
        self.queue.in_flight += 1
        self.ctrl.traffic_seen = True
        entry.in_flight += 1
        conn.cmds.add(cmd)
        conn.read_wait.append(cmd)
        conn.pump_reads()
        self.served += 1
        return True

    def data_ready(self, cmd):
        """``TargetQueue.data_ready`` for a command whose RDMA READs all completed: True if it is
        a :class:`FastWrite` (written and answered here, or, when the namespace changed since it
        was checked, a response waits for a slot or the ``pwrite`` fails, run by the Python queue
        as its request, which writes it again and reports any error); False for the queue's own
        request. The ends are ``TargetQueue._complete``'s (SQHD, counters, the namespace hold)
        and ``pump_responses``' (the SEND, SEND_WITH_INV when the SGL asks for it, the
        receive's re-post); the data slot stays the command's until the SEND completes
        (:meth:`_sent`)."""
        if type(cmd.req) is not FastWrite:
            return False
        cdef FastWrite w = <FastWrite>cmd.req
        cdef FastNamespace ns = w.ns
        cdef FastFile f = ns.file
        cdef int fd = f.fd
        cdef uintptr_t addr
        cdef Py_ssize_t done = -1
        slot = cmd.data
        if (ns.accessible and fd >= 0 and not f.read_only and w.nsobj.backend is ns.backend and not self.resp_wait
                and self.resp_pool.available):
            addr = slot.addr
            with nogil:
                done = _pwrite_all(fd, <const unsigned char*>addr, w.length, w.offset)
        if done != w.length:
            req = cmd.req = self.queue.adopt_write(w.sqe, w.start_ns, w.nsobj, slot.view[:w.length], cmd)
            self.queue.data_ready(req)
            return True
        rslot = self.resp_pool.get()
        cdef Py_ssize_t i = rslot.index
        cdef uintptr_t raddr = rslot.addr
        write_cqe(<unsigned char*>raddr, next_sqhd(self.queue, &self.shape), self.shape.qid, w.cid)
        count_io(self.counters, ns, _KIND_WRITE, w.length, w.start_ns)
        # a removed namespace's copy is withdrawn (not accessible) first, so the queue, not this,
        # gives back the last hold of one and closes its file
        w.nsobj.in_flight -= 1
        conn = self.conn
        conn.cmds.discard(cmd)
        cmd.data = None
        self.resp_cmd[i] = slot  # given back with the SEND's completion, as a Read's
        if w.sgl_id == _KEYED_INVALIDATE:
            self.send_out.append(((self.send_kind << self.kind_shift) | i, _WR_SEND_WITH_INV, _SIGNALED, raddr,
                                  _CQE_SIZE, self.resp_lkey, w.sgl_key, 0, 0))
        else:
            self.send_out.append(((self.send_kind << self.kind_shift) | i, _WR_SEND, _SIGNALED, raddr, _CQE_SIZE,
                                  self.resp_lkey, 0, 0, 0))
        self.recv_out.append(self.recv_wrs[cmd.recv])
        cmd.recv = -1
        self.fetched += 1
        if not conn.batching:
            conn.flush()
        return True

    def request(self, cmd):
        """The queue's :class:`target.request.Request` for ``cmd`` (``RdmaCommand``), made from its
        :class:`FastWrite` as ``TargetQueue.submit`` would have left it waiting for its data,
        holding what the FastWrite holds (so ``data_failed`` ends it as the queue ends its own),
        and stored in ``cmd.req``; ``cmd.req`` itself when it is the queue's already."""
        if type(cmd.req) is not FastWrite:
            return cmd.req
        cdef FastWrite w = <FastWrite>cmd.req
        req = cmd.req = self.queue.adopt_write(w.sqe, w.start_ns, w.nsobj, None, cmd)
        return req

    cdef bint _sent(self, Py_ssize_t idx, unsigned int status) except -1:
        """The SEND completion of a command served here (``RdmaTargetConnection._send_done`` and
        ``TargetQueue.response_sent``): its response slot, its data slot (kept until the QP is
        gone on a closing connection) and its command-pool place back; False: not one of ours."""
        entry = self.resp_cmd[idx]
        if entry is None or type(entry) is self.cmd_type:
            return False
        self.resp_cmd[idx] = None
        self.resp_pool.put(self.resp_slots[idx])
        conn = self.conn
        if entry is False:
            pass  # a write from the receive buffer: no data slot
        elif conn.closing and not conn.destroyed:
            conn.held.append(entry)  # maybe still posted: free once the QP is gone
        else:
            self.data.put(entry)
        if status and not conn.closing:
            conn.wc_failed("SEND", status)
            return True
        self.queue.in_flight -= 1
        if self.resp_wait:
            conn.pump_responses()
        return True
