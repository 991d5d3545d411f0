"""The asyncio side of NVMe/TCP framing, shared by the target and the host: the receive protocol
that feeds a :class:`~blockd.tcp_pdu.PduReader`, and the batcher that puts its output into few writes.

:mod:`blockd.tcp_pdu` stays free of the event loop and sockets (it is fed bytes and returns
bytes); this module is the one place where those bytes meet an ``asyncio`` transport.
"""

from __future__ import annotations

import asyncio

from blockd.dataplane import twin
from blockd.tcp_pdu import PduReader

__all__ = ["OutputBatcher", "PduProtocol"]

OutputBatcher = twin("blockd._output").OutputBatcher
"""The batcher both ends' connections use: compiled (``blockd/_output.pyx``, which the compiled
``initiator/_tcp_host_io.pyx`` and ``target/_tcp_io.pyx`` call from C) or the Python reference
(:mod:`blockd.output`)."""


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
