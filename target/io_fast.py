"""The target's compiled I/O path, or None: what :mod:`target.tcp` and :mod:`target.backend` use.

The compiled path (``target/_tcp_thread.pyx`` and ``_tcp_io.pyx`` over ``_io_core.pyx`` and
``_file_io.pyx``) runs when :mod:`blockd.dataplane` chose the compiled
plane (``BLOCKD_PURE=1`` turns it off) and its extension was built; otherwise the names below are
None and every command goes through the Python :class:`target.queue.TargetQueue`, the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockd.dataplane import twin

if TYPE_CHECKING:
    from target.subsystem import Namespace

__all__ = ["FastFile", "FastNamespace", "RdmaFastPath", "TcpFastPath", "TcpUringPath", "fast_namespace",
           "uring_queues"]

_file = twin("target._file_io")
FastFile = getattr(_file, "FastFile", None)
FastNamespace = getattr(_file, "FastNamespace", None)
TcpFastPath = getattr(twin("target._tcp_thread"), "TcpFastPath", None)
RdmaFastPath = getattr(twin("target._rdma_fast"), "RdmaFastPath", None)
_uring = twin("target._uring_loop", hint="liburing-dev")
TcpUringPath = getattr(_uring, "TcpUringPath", None)


def uring_queues(wanted: bool, sqpoll_idle_ms: int = 0) -> tuple[bool, str]:
    """Whether the NVMe/TCP queue threads run on io_uring (``target/_uring_loop.pyx``), and why
    not when they do not: not wanted (``io_uring_queues`` or ``threaded_queues`` off), the
    compiled loop missing, or this kernel refusing a ring (asked once, by making one as the
    threads will: with SQPOLL when ``sqpoll_idle_ms``)."""
    if not wanted:
        return False, "io_uring_queues or threaded_queues is off"
    if TcpUringPath is None:
        return False, "the compiled io_uring loop (target._uring_loop) is not running on this plane"
    reason = _uring.probe(sqpoll_idle_ms)
    return not reason, reason


def fast_namespace(ns: Namespace) -> object | None:
    """The C copy of ``ns`` for the compiled path, or None when the path cannot serve it: only a
    plain :class:`target.backend.FileBackend` goes fast, the one backend that makes a
    :class:`FastFile` (a filter, a replicated or memory backend keeps its semantics in Python)."""
    file = getattr(ns.backend, "fast", None)
    if FastNamespace is None or file is None:
        return None
    return FastNamespace(file, ns.backend, ns.lba_shift, ns.counters)
