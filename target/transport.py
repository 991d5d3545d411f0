"""What the target core needs from a transport, and the registry of transports by name.

Modelled on the kernel's ``struct nvmet_fabrics_ops`` (drivers/nvme/target/nvmet.h): a transport
states what it is (:class:`TransportInfo`: TRTYPE, the SGL descriptors it carries data with, its
in-capsule sizes, its largest transfer, TSAS and SGLS) and offers the two data movements the
core asks for (:class:`TargetTransport`). The core never names a transport; the only place a
name maps to a transport is :func:`transport_info` / :func:`listen`, from the port's
configuration.

The core drives each request; a transport only frames bytes and moves data:

* it hands every command capsule to :meth:`target.queue.TargetQueue.submit`;
* on :meth:`TargetTransport.fetch_data` it fetches the host's data (R2T + H2CData, RDMA READ)
  into ``req.data`` and ends in exactly one of ``queue.data_ready(req)`` /
  ``queue.data_failed(req)``;
* on :meth:`TargetTransport.queue_response` it sends ``req.reply`` if there is one (C2HData,
  RDMA WRITE) and the completion ``req.cqe`` (CapsuleResp, SEND), then calls
  ``queue.response_sent(req)`` once the response has left;
* on :meth:`TargetTransport.settle` (an I/O Connect finds the queue's QID taken) it says whether
  the connection has in fact ended and, if so, detaches its queue at once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from target.file_send import PipedRead
    from target.request import Request
    from target.target import PortInfo, Target


DEFAULT_MAX_TRANSFER = 1 << 20
"""Largest data transfer of one command on both transports (Identify MDTS = 8: 2^8 x 4 KiB)."""


@dataclass(frozen=True)
class TransportInfo:
    """A transport's identity, as Identify Controller and the discovery log describe it."""

    name: str
    """The configuration's name for it (``transport = "tcp"``)."""
    trtype: int
    """Discovery log TRTYPE (:class:`protocol.constants.TransportType`)."""
    data_sgl_ids: frozenset[int]
    """SGL descriptor identifiers the transport moves data with, besides in-capsule data."""
    keyed_sgls: bool
    """SGL1 is a Keyed SGL Data Block (address, 24-bit length, key), as NVMF_KEYED_SGLS."""
    admin_inline: int
    """In-capsule data bytes an admin queue accepts."""
    io_inline: int
    """In-capsule data bytes an I/O queue accepts (Identify IOCCSZ)."""
    max_transfer: int
    """Largest data transfer of one command (bytes); Identify MDTS must not exceed it."""
    sgls: int
    """Identify Controller SGLS."""
    tsas: bytes
    """Discovery log entry TSAS (256 bytes)."""


class TargetTransport(Protocol):
    """One transport connection carrying one queue (admin or I/O)."""

    info: TransportInfo
    read_buffer: Callable[[Request], memoryview | PipedRead | None] | None
    """Memory a read on an I/O queue may fill in place (exactly ``req.length`` bytes, e.g.
    the registered memory RDMA WRITE sends from), or None when there is none free now (or,
    NVMe/TCP, a :class:`target.file_send.PipedRead`: the Read's data goes by reference); the
    attribute itself is None for a transport that sends from any buffer."""

    def fetch_data(self, req: Request) -> None:
        """Get the host's data for ``req`` into ``req.data``; end in ``queue.data_ready(req)``
        or ``queue.data_failed(req)``, now or later."""

    def queue_response(self, req: Request) -> None:
        """Send ``req.reply`` (when not None) and the completion ``req.cqe``; call
        ``queue.response_sent(req)`` when it has left. A closing connection drops it."""

    def close(self) -> None:
        """End the connection (the controller is torn down, or the host misbehaved)."""

    def served_by(self) -> dict[str, Any]:
        """How many of this queue's commands each compiled part served, and which (the control
        socket's ``hosts``: how an operator, and the VM tests, see that a setting such as
        ``io_uring_queues`` is really in use rather than its fallback); {} when there is nothing
        to tell (the Python plane: the queue's own code serves every command)."""

    def settle(self) -> bool:
        """The connection has ended, though the core has not been told (its host closed it, or
        the target is closing it, and the transport's teardown is still on its way): detach the
        queue from its controller now (``queue.close()``) and return True; False if it is live.

        Called when an I/O Connect names this queue's QID, so that a host reconnecting at once
        gets its queue rather than a Command Sequence Error for a queue that is already dead.
        (nvmet has no such operation: its queues are released by a work item, and a Connect in
        between gets Command Sequence Error with DNR.)"""


class Listener(Protocol):
    """A listening port of one transport."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


_REGISTRY = {"tcp": ("target.tcp", "TcpListener"), "rdma": ("target.rdma", "RdmaListener")}
"""Configuration name -> (the module that implements the transport, its listener class). Each
module has ``INFO``, its :class:`TransportInfo`; imported on first use, so a TCP-only target
never loads the RDMA module's dependencies."""


def transport_names() -> tuple[str, ...]:
    """The names a port's ``transport`` may take, the default (``tcp``) first."""
    return tuple(_REGISTRY)


def transport_info(name: str) -> TransportInfo:
    """The identity of transport ``name``; KeyError for an unknown one."""
    return importlib.import_module(_REGISTRY[name][0]).INFO


def listen(target: Target, port: PortInfo) -> Listener:
    """A listener for ``port`` on the transport its configuration names."""
    module, listener = _REGISTRY[port.transport]
    return getattr(importlib.import_module(module), listener)(target, port)

