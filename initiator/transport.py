"""What the host's controller needs from a transport, and the registry of transports by name.

The host side of :mod:`target.transport`: each transport module (``initiator.tcp``,
``initiator.rdma``) offers ``open_queue(params, queue, on_lost)``, a :data:`QueueOpener`,
returning a :class:`QueueConnection`; the controller never names a transport, it asks
:func:`queue_opener` for the one ``params.transport`` names. The connect parameters' choices
(:mod:`initiator.params`) are this registry's names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from initiator.errors import ConnectError

if TYPE_CHECKING:
    from initiator.params import ConnectParams
    from initiator.queue import HostCommand, HostQueue

LostCallback = Callable[[Any, "Exception | None"], None]
"""What a transport calls once when its connection is gone (with why, if it knows)."""


class QueueConnection(Protocol):
    """What a transport's per-queue connection offers the controller."""

    queue: HostQueue
    inline_limit: int
    closed: bool
    connect_cattr: int
    """CATTR this transport's I/O queues are connected with (see protocol.fabrics)."""

    def submit(self, cmd: HostCommand) -> None:
        """Send ``cmd`` (the queue has room); transports that batch send it by the end of this
        loop iteration, or at ``release`` inside a hold."""

    def hold(self) -> None:
        """Keep what ``submit`` sends until ``release``, which sends it; holds nest."""

    def release(self) -> None: ...

    def close(self) -> None: ...


QueueOpener = Callable[["ConnectParams", "HostQueue", LostCallback], Awaitable[QueueConnection]]
"""How every transport opens one queue: ``open_queue(params, queue, on_lost)`` in its module;
raises :class:`ConnectError` with one line for the user when it cannot."""

TRANSPORTS = {"tcp": "initiator.tcp", "rdma": "initiator.rdma"}
"""Transport name -> the module whose ``open_queue`` is its :data:`QueueOpener` (imported when
first used: the RDMA one needs pyverbs). The same names as the target's registry
(:func:`target.transport.transport_names`), the default first."""


def queue_opener(transport: str) -> QueueOpener:
    try:
        module = TRANSPORTS[transport]
    except KeyError:
        raise ConnectError(f"unknown transport {transport!r} (use {' or '.join(TRANSPORTS)})") from None
    opener: QueueOpener = importlib.import_module(module).open_queue
    return opener
