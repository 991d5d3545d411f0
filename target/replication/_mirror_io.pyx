# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Twin of :meth:`target.replication.mirror.ReplicatedBackend.write` in its steady case: the
compiled target path's replicated write.

Profiled before (py-spy of the primary at QD1 with one replica, 2026-12-07, docs/benchmarks.md):
the primary spent ~108 µs of user time per replicated 4 KiB write (8 µs unreplicated, on the
queue's thread): of its samples, a quarter in the Python target core (``TargetQueue.submit``, the
``Request``, ``Controller._check_rw``, ``_complete``, ``queue_response``), a quarter in the
mirror's ``write`` with the send to the replica, a third in the asyncio task the write became
while it waited for the replica (``eager.start``'s task, its future, the loop's callbacks). The compiled TCP path
(``target/_tcp_io.pyx``) now hands an in-capsule Write without FUA to a replicated namespace,
accepted by the core's rule ``target._io_core.mirror_eligible``, to :meth:`MirrorLane.submit`, on
the event loop (where the replica associations live), which takes it only when every rule of the
reference holds *now* with nothing to wait for:

- this copy is the primary, no region is being copied (resync, verify), and every replica is in
  sync (``min_in_sync`` then holds, no generation is started, nothing is missed);
- every bit of its regions is on disk already (``WriteIntentBitmap.marked``: bitmap before data);
- it overlaps no command in flight: it joins the region lists (``ReplicatedBackend.join``, the
  one implementation) and, if an earlier overlapping command is there, leaves them again
  (``_end``) and declines, so that the reference's ``_begin`` joins it in the same place and
  waits (the ordering of overlapping writes).

Then, in the reference's order, it sends the write to every replica (``submit_write``, the host
library's compiled lane: on loopback the send itself carries the replica's TCP receive and its
wake-up), and only then writes the local copy (``pwrite``, the GIL released), so that this
copy's write runs while the replicas' are on their way instead of before them: at QD1 a
replicated write costs the host the longer of the two, not their sum
(docs/benchmarks.md, "The replicated write's floor"). It answers the host once every copy took
it (``_end`` first: a later overlapping write waits for that). Anything else is declined before
anything happened, and the capsule goes to the Python queue and ``ReplicatedBackend.write``,
which decides: FUA (to every copy), a bit to set, a replica away or resyncing, an overlap, a
closed local copy. A replica that fails a write this lane sent ends in
:meth:`ReplicatedBackend.fast_write_failed` (the reference's ``_lost``, the new generation,
``min_in_sync``); a local ``pwrite`` that fails, the replicas having the write already, is
the reference's ``local_failed`` (every replica misses the regions and resyncs them from this
copy) and the host gets the device's error (``OSError``, its errno: Capacity Exceeded for
ENOSPC, else Write Fault, ``Controller.write_error``) once the replicas answered; either goes
to the host through the Python queue. ``tests/replication/test_mirror_fast.py`` holds the two
paths together.
"""

from libc cimport errno as c_errno
from posix.types cimport off_t

from target._file_io cimport FastFile, _pwrite_all

import functools
import os


cdef class MirrorWrite:
    """One write the lane sent: the copies still to answer (the local one included), the
    replicas that failed, and the local copy's error."""

    cdef MirrorLane lane
    cdef object me
    cdef object regions
    cdef int pending
    cdef int sent
    cdef list failed
    cdef object local_error
    cdef object reply

    def done(self, link, exc):
        """``submit_write``'s ``done`` for ``link`` (``exc`` None: it took the write)."""
        if exc is not None:
            self.failed.append((link, exc))
        self._one_done()

    cdef int _one_done(self) except -1:
        """A copy ended; the host is answered when the last one did (never before the local
        ``pwrite``, which counts as one: a replica may answer, or fail, during the sends)."""
        self.pending -= 1
        if self.pending:
            return 0
        mirror = self.lane.mirror
        if self.failed:
            mirror.fast_write_failed(self.failed, self.sent, self.regions, self.me, self.reply, self.local_error)
            return 0
        mirror._end(self.regions, self.me)
        if self.local_error is not None:
            self.reply(self.local_error)
            return 0
        self.lane.served += 1
        self.reply(None)
        return 0


cdef class MirrorLane:
    """The compiled way into one :class:`~target.replication.mirror.ReplicatedBackend`
    (module docstring); made by it over its local copy's :class:`FastFile`."""

    def __init__(self, mirror, FastFile file):
        # (link's state names, imported here: the compiled TCP path cimports this module while
        # target.backend, which the replication package imports, may still be initialising)
        from target.replication.link import IN_SYNC
        self.in_sync = IN_SYNC
        self.mirror = mirror
        self.file = file
        self.size = mirror.data_size
        self.shift = mirror.region_size.bit_length() - 1

    cdef bint submit(self, unsigned long long offset, bytes data, object reply) except -1:
        """Take the write of ``data`` at ``offset`` (in the data area, checked by the caller):
        True, and ``reply(None)`` or ``reply(error)`` once it ended (never before this returns
        for a success; the caller counts the command in flight first); False, nothing done, and
        the caller hands it to the Python queue."""
        cdef Py_ssize_t length = len(data), done
        cdef int err = 0
        cdef FastFile f = self.file
        cdef int fd = f.fd
        cdef const unsigned char* p = <const unsigned char*><const char*>data
        m = self.mirror
        links = m.links
        if (not length or fd < 0 or f.read_only or not m.primary or m.copying or not links
                or len(links) + 1 < m.min_in_sync):
            self.declined += 1
            return False
        for link in links:
            if link.state != self.in_sync:
                self.declined += 1
                return False
        if not m.marked(offset, length):
            self.declined += 1
            return False
        regions = range(offset >> self.shift, ((offset + length - 1) >> self.shift) + 1)
        me, earlier = m.join(offset, length, regions)
        if earlier:
            m._end(regions, me)
            self.declined += 1
            return False
        cdef MirrorWrite w = MirrorWrite.__new__(MirrorWrite)
        w.lane = self
        w.me = me
        w.regions = regions
        w.sent = len(links)
        w.pending = w.sent + 1  # the replicas and this copy
        w.failed = []
        w.reply = reply
        for link in links:
            try:
                link.io.submit_write(offset, data, False, functools.partial(w.done, link))
            except Exception as exc:  # refused before it was sent (LINK_ERRORS)
                w.done(link, exc)
        with nogil:  # this copy's write while the replicas' travel (the module docstring)
            c_errno.errno = 0
            done = _pwrite_all(fd, p, length, <off_t>offset)
            if done != length:
                err = c_errno.errno or c_errno.EIO  # (a pwrite that wrote nothing and set no errno: EIO)
        if done != length:  # ReplicatedBackend._write_local's end: the replicas resync these regions
            w.local_error = OSError(err, os.strerror(err))
            m.local_failed(regions)
        w._one_done()
        return True

    def write(self, unsigned long long offset, bytes data, reply):
        """:meth:`submit` for Python callers: the tests' handle on the lane
        (``tests/replication/test_mirror_fast.py``), which the target's transport reaches in C."""
        return self.submit(offset, data, reply)
