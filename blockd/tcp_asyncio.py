"""The asyncio side of NVMe/TCP framing, shared by the target and the host: the receive protocol
that feeds a :class:`~blockd.tcp_pdu.PduReader` and the policy that batches output into few writes.

:mod:`blockd.tcp_pdu` stays free of the event loop and sockets (it is fed bytes and returns
bytes); this module is the one place where those bytes meet an ``asyncio`` transport.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from blockd.tcp_pdu import PduReader


class OutputBatcher:
    """Coalesces the PDUs produced while handling input into a single socket write.

    Every completion used to cost its own ``send`` (two for a read: C2HData, then the
    CapsuleResp), and on loopback the syscall dominated the per-I/O cost. Between ``hold()``
    and ``release()`` (a receive callback, say; holds nest) buffers only queue, and ``release`` sends them
    together; sends outside a hold go out once the loop has run everything that was ready.
    Order is kept either way.

    ``on_backlog`` is called after a write that left bytes in the transport's buffer (the peer
    reads less than we send); a peer that keeps up costs one length read per write.
    """

    def __init__(self, transport: asyncio.Transport, on_backlog: Callable[[], None] | None = None) -> None:
        self.transport = transport
        self.on_backlog = on_backlog
        self._bufs: list[bytes | memoryview] = []
        self._held = 0
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def hold(self) -> None:
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if not self._held and self._bufs:
            self.flush()

    def send(self, bufs: list[bytes | memoryview]) -> None:
        self._bufs.extend(bufs)
        if not self._held and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        bufs, self._bufs = self._bufs, []
        if not bufs or self.transport.is_closing():
            return
        if len(bufs) == 1:
            self.transport.write(bufs[0])
        elif sum(map(len, bufs)) <= 65536:
            self.transport.write(b"".join(bufs))
        else:
            self.transport.writelines(bufs)
        if self.on_backlog is not None and self.transport.get_write_buffer_size():
            self.on_backlog()


class PduProtocol(asyncio.BufferedProtocol):
    """The receive side both NVMe/TCP ends share: bytes go where ``reader`` says, and whatever
    handling them produces (replies, R2T answers, new capsules) leaves in one send at the end."""

    reader: PduReader
    out: OutputBatcher

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.out.hold()
        try:
            self._receive(nbytes)
        finally:
            self.out.release()

    def _receive(self, nbytes: int) -> None:
        """Handle the PDUs ``nbytes`` more bytes completed (``reader.buffer_updated``)."""
        raise NotImplementedError
