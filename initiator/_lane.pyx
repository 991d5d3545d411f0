# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled I/O lane of a :class:`~initiator.controller.Controller`: its steady-state
``transfer`` (one command, live association, a queue with room) and that command's successful
completion, in C.

Profiled before (cProfile of ``tests/bench/bench_fuse_path.py``), a 4 KiB FUSE read ran eleven
Python frames in the controller between the compiled FUSE loop and the compiled transport:
``transfer``, ``check_range``, ``read_command``, ``submit_io``, ``_submit``, ``_io_with_room``,
``Event.is_set``, ``_send``, the queue's ``has_room`` and, on the way back, ``_complete``. Here
they are one C call each way. The reference is the controller's own Python path, which stays
the one place that splits transfers and the one primitive (``submit_io``): :meth:`IoLane.transfer`
serves a range that needs exactly one command on a live association whose first I/O queue with
room is open, and hands every other call, unchanged, to ``Controller.transfer`` (a multi-command
range, an unaligned or outside one, no such namespace, a failed or reconnecting association, no
room: each answered, raised or parked there exactly as before). A command it sent completes
through :meth:`IoLane.io_done`, which counts it and runs the caller's ``done`` for a success
with nothing parked, and gives every other completion (a status, an error, parked commands
waiting for the freed id) to ``Controller._complete``. ``tests/core/test_lane_differential.py``
drives a controller with the lane and one without through the same random calls and
completions and compares every capsule sent, callback, exception and counter.

The compiled FUSE loop's FSYNC sends its Flush (an SQE built by ``flush_command``) through
:meth:`IoLane._submit_io`, ``Controller.submit_io`` in C on the same terms: the same send as a
transfer's (``_send_sqe``), else the controller's own ``submit_io``
(``tests/core/test_fuse_lane_differential.py`` mixes FSYNCs into its request batches).

The command is the controller's :class:`~initiator._queue.Command`, made without its Python
``__init__`` (fields set in C); its SQE is built here from a template made by
:func:`protocol.commands.read_command` / ``write_command`` at import, with NSID, SLBA, NLB and
the FUA bit stored at the offsets :data:`protocol.nvme.RW_COMMAND` gives (checked against those
builders at import, and for random values by the test).
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from blockd._iostats cimport IoCounters, now_ns
from blockd._le cimport st16, st32, st64
from initiator._queue cimport Command, HostConnection, HostQueue

from protocol.commands import read_command, write_command
from protocol.layout import field_offset
from protocol.nvme import RW_COMMAND, RW_CONTROL_FUA, SQE_SIZE

cdef Py_ssize_t _SQE = SQE_SIZE
cdef Py_ssize_t _O_NSID = field_offset(RW_COMMAND, "nsid")
cdef Py_ssize_t _O_SLBA = field_offset(RW_COMMAND, "slba")
cdef Py_ssize_t _O_NLB = field_offset(RW_COMMAND, "nlb")
cdef Py_ssize_t _O_CONTROL = field_offset(RW_COMMAND, "control")
cdef uint32_t _FUA = RW_CONTROL_FUA
cdef bytes _READ_SQE = bytes(read_command(0, 0, 0))
cdef bytes _WRITE_SQE = bytes(write_command(0, 0, 0))
cdef uint64_t _NLB_MAX = 0xFFFF


cdef bytearray _rw_sqe(bint write, uint32_t nsid, uint64_t slba, uint32_t nlb0, bint fua):
    """``write_command(nsid, slba, nlb0, fua)`` or ``read_command(nsid, slba, nlb0)``."""
    cdef bytearray sqe = PyByteArray_FromStringAndSize(NULL, _SQE)
    cdef uint8_t* s = <uint8_t*>PyByteArray_AS_STRING(sqe)
    memcpy(s, <const char*>(_WRITE_SQE if write else _READ_SQE), _SQE)
    st32(s + _O_NSID, nsid)
    st64(s + _O_SLBA, slba)
    st16(s + _O_NLB, nlb0)
    if write and fua:  # a read has no FUA (read_command takes none)
        st16(s + _O_CONTROL, _FUA)
    return sqe


def rw_sqe(bint write, uint32_t nsid, uint64_t slba, uint32_t nlb0, bint fua=False):
    """The SQE the lane sends (for the test that ties it to :mod:`protocol.commands`)."""
    return _rw_sqe(write, nsid, slba, nlb0, fua)


if (rw_sqe(False, 0x01020304, 0x1112131415161718, 0x2122, False) != read_command(0x01020304, 0x1112131415161718, 0x2122)
        or rw_sqe(True, 0xA1A2A3A4, 0xB1B2B3B4B5B6B7B8, 0xC1C2, True)
        != write_command(0xA1A2A3A4, 0xB1B2B3B4B5B6B7B8, 0xC1C2, True)):
    raise ImportError("protocol.commands' Read/Write SQEs are not the ones initiator/_lane.pyx builds")


cdef class IoLane:
    """The lane of one controller: ``transfer`` and ``io_done`` (see the module docstring).

    What the lane reads of the controller per I/O is mirrored into C fields rather than read
    as Python attributes (about a dozen attribute reads and two ``loop.time`` method lookups
    per I/O before, ~2.5k of the host's ~22k instructions per 4 KiB FUSE read):

    - the association's state, re-read by :meth:`sync`, which the controller calls whenever
      one of them changes: ``_set_live`` (every reconnect ends there, after ``_establish`` has
      replaced ``io``, ``max_transfer`` and the namespace table), ``_set_failed`` and
      ``_set_namespaces`` (a rescan while live). ``ready`` is ``live and failed is None``;
      ``io``, ``namespaces`` the controller's list and dict themselves (changed in place, they
      need no sync; replaced, they go through one of those setters); ``time`` the event loop's
      bound ``time``;
    - what the controller never replaces after ``__init__``: its counters, its two parked
      deques and the command timeout, taken here once.

    ``tests/core/test_lane_differential.py`` changes each of them (reconnects onto new queues
    with another ``max_transfer``, failure and recovery, other namespace tables) between random
    transfers, so a mirror that went stale would send what the reference refuses, or the
    reverse. (The fields are declared in ``_lane.pxd``.)"""

    def __init__(self, ctrl, reference, complete, parked_io, parked_admin, double timeout):
        """``reference``: the Python ``Controller.transfer``, called as ``reference(ctrl, ...)``;
        ``complete``: the controller's ``_complete`` (every completion but a plain success);
        ``parked_io``/``parked_admin``: its parked-command lines (a success with one waiting goes
        to ``complete``, which sends it); ``timeout``: its I/O command timeout. The controller
        hands these over itself rather than the lane reading them by private name (issue 36:
        what the lane reads of the controller is its public interface plus what it is given).
        Made at the end of the controller's ``__init__``, which then calls :meth:`sync`."""
        self.ctrl = ctrl
        self.reference = reference
        self.complete = complete
        self.on_done = self.io_done  # bound once: every command this lane sends
        self.counters = ctrl.counters
        self.parked_io = parked_io
        self.parked_admin = parked_admin
        self.timeout = timeout

    def sync(self, loop, bint live):
        """Read the association's state again (class docstring: the controller's setters call
        this, with its event loop, None before the first connect, and whether it is live)."""
        ctrl = self.ctrl
        if loop is not None:
            self.time = loop.time
        self.ready = ctrl.failed is None and live and loop is not None
        self.io = ctrl.io
        self.namespaces = ctrl.namespaces
        self.max_transfer = ctrl.max_transfer

    def transfer(self, bint write, nsid, offset, buf, done, fua=False):
        """``Controller.transfer`` (same arguments, same effects)."""
        self._transfer(write, nsid, offset, buf, done, fua)

    cdef int _transfer(self, bint write, nsid, offset, buf, done, fua) except -1:
        """``transfer`` for C callers (the compiled FUSE loop)."""
        if not self._send(write, nsid, offset, buf, done, fua):
            self.reference(self.ctrl, write, nsid, offset, buf, done, fua)
        return 0

    cdef bint _send(self, bint write, nsid, offset, buf, done, fua) except -1:
        """Send the one command of a steady-state transfer; False, having done nothing, for
        any other case."""
        cdef uint64_t off, length, bs, size
        cdef uint32_t ns
        if not self.ready or type(nsid) is not int or type(offset) is not int:
            return False
        try:  # a negative or too large value: the reference's error
            ns = nsid
            off = offset
        except OverflowError:
            return False
        info = self.namespaces.get(nsid)
        if info is None:
            return False
        length = len(buf)
        bs = info.block_size
        size = info.size
        if (not length or not bs or off % bs or length % bs or off > size or length > size - off
                or length > self.max_transfer or length // bs - 1 > _NLB_MAX):
            return False
        return self._send_sqe(_rw_sqe(write, ns, off // bs, <uint32_t>(length // bs - 1), fua),
                              buf if write else None, None if write else buf, done)

    cdef int _submit_io(self, sqe, data_out, data_in, done) except -1:
        """``Controller.submit_io`` for C callers (the compiled FUSE loop's Flush): sent here on
        a live association whose first I/O queue with room is open, else the controller's."""
        if not (self.ready and self._send_sqe(sqe, data_out, data_in, done)):
            self.ctrl.submit_io(sqe, data_out, data_in, done)
        return 0

    cdef bint _send_sqe(self, sqe, data_out, data_in, done) except -1:
        """Send ``sqe`` on the first I/O queue with room, as ``Controller._submit`` and ``_send``
        (the caller checked ``ready``); False, having done nothing, when none has room or it is
        closed."""
        cdef Command cmd
        conn = None
        for c in self.io:  # Controller._io_with_room
            q = (<HostConnection>c).queue if isinstance(c, HostConnection) else c.queue
            if not isinstance(q, HostQueue):
                return False
            if (<HostQueue>q)._count > 0:
                conn = c
                break
        if conn is None:
            return False
        compiled = isinstance(conn, HostConnection)  # a compiled transport's, whichever it is
        if (<HostConnection>conn).closed if compiled else conn.closed:
            return False
        cmd = Command.__new__(Command)
        cmd.sqe = sqe
        cmd.data_out = data_out
        cmd.data_in = data_in
        cmd.cid = -1
        cmd.on_done = self.on_done
        cmd.done = done
        cmd.timeout = self.timeout
        cmd.deadline = self.time() + self.timeout
        cmd.sent_ns = now_ns()
        if compiled:  # its hold, submit and release as one C call (the TCP one's: its batcher's)
            (<HostConnection>conn)._send_now(cmd)
            return True
        conn.hold()  # out now (unless held further up), as Controller._send
        try:
            conn.submit(cmd)
        finally:
            conn.release()
        return True

    def io_done(self, Command cmd, exc):
        """``on_done`` of the commands this lane sent: ``Controller._complete``'s common case."""
        if exc is None and not cmd.status and not self.parked_io and not self.parked_admin:
            cmd._count(self.counters, now_ns())
            cmd.done(None)
        else:
            self.complete(cmd, exc)
