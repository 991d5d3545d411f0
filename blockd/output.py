"""The output batcher's Python reference (its compiled twin: ``blockd/_output.pyx``;
:mod:`blockd.tcp_asyncio` picks through :func:`blockd.dataplane.twin`)."""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable

JOIN_LIMIT = 65536
"""Buffers totalling at most this many bytes are joined into one ``write``; more go to
``writelines``, which under uvloop (:mod:`blockd.eventloop`) hands them to the socket without
joining them. Python 3.11's selector transport, the fallback loop, joins them into one copy
(its ``writelines`` is ``write(b"".join(...))``), so there a large send costs that copy once
more. The compiled twin reads this value."""


class OutputBatcher:
    """Coalesces the PDUs produced while handling input into a single socket write.

    Every completion used to cost its own ``send`` (two for a read: C2HData, then the
    CapsuleResp), and on loopback the syscall dominated the per-I/O cost. Between ``hold()``
    and ``release()`` (a receive callback, say; holds nest) buffers only queue, and ``release`` sends them
    together; sends outside a hold go out once the loop has run everything that was ready.
    Order is kept either way.

    ``on_backlog`` is called after a write that left bytes in the transport's buffer (the peer
    reads less than we send); a peer that keeps up costs one length read per write. ``loop``
    runs the flush a send outside a hold schedules (default: the running loop; the
    differential test gives both twins a recording one).
    """

    def __init__(self, transport: asyncio.Transport, on_backlog: Callable[[], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.transport = transport
        self.on_backlog = on_backlog
        self._bufs: list[bytes | memoryview] = []
        self._held = 0
        self._scheduled = False
        self._loop = asyncio.get_running_loop() if loop is None else loop

    def hold(self) -> None:
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if not self._held and self._bufs:
            self.flush()

    def send(self, bufs: Iterable[bytes | memoryview]) -> None:
        self._bufs.extend(bufs)
        if not self._held and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def take(self) -> list[bytes | memoryview]:
        """The buffers queued and not written yet, oldest first, handed over: for a caller that
        writes them to the socket itself, ahead of what it sends there (``target/file_send.py``)."""
        bufs, self._bufs = self._bufs, []
        return bufs

    def flush(self) -> None:
        self._scheduled = False
        bufs, self._bufs = self._bufs, []
        if not bufs or self.transport.is_closing():
            return
        if len(bufs) == 1:
            self.transport.write(bufs[0])
        elif sum(map(len, bufs)) <= JOIN_LIMIT:
            self.transport.write(b"".join(bufs))
        else:
            self.transport.writelines(bufs)
        if self.on_backlog is not None and self.transport.get_write_buffer_size():
            self.on_backlog()
