"""What the target refused or held back from its hosts, counted by reason (issue 16): the
operator's view of hostile or over-limit input, read by the control socket (``blockctl target
stats``) and exported to Prometheus as ``blockd_target_rejections_total{reason=...}``.

Each refusal adds one where it happens (a framing error, a limit, a timeout, a failed Connect or
authentication); nothing is counted on the good path, so the table costs the data path nothing.
Reason names are stable (docs/operations.md lists them): every fixed reason is in the table from
the start, at zero, so that a dashboard sees the series before the first refusal.
"""

from __future__ import annotations

from blockd.iostats import status_label
from protocol.tcp import TermReqFes

CONNECTIONS_TOTAL = "connections_total"
"""A connection closed at accept: ``max_connections`` were open."""
CONNECTIONS_PER_HOST = "connections_per_host"
"""A connection closed at accept: its source address had ``max_connections_per_host`` open."""
HELLO_TIMEOUT = "hello_timeout"
"""A connection closed: no ICReq and Connect within ``hello_timeout``."""
PDU_TIMEOUT = "pdu_timeout"
"""A connection closed: one PDU took longer than ``pdu_timeout`` to arrive."""
KEEP_ALIVE_TIMEOUT = "keep_alive_timeout"
"""A controller torn down: its host sent nothing for its keep-alive timeout."""
COMMAND_POOL_EXHAUSTED = "command_pool_exhausted"
"""A command refused (Command Sequence Error): the queue had twice its size in flight."""
R2T_BUDGET_WAIT = "r2t_budget_wait"
"""A write whose R2T had to wait: its queue's or the daemon's write-buffer budget was full (the
write is not refused, it waits; a steady count shows hosts pushing more than the budget)."""
INCAPSULE_TOO_LARGE = "incapsule_too_large"
"""A capsule carried more in-capsule data than the queue takes (the connection is then
terminated with Data Transfer Out of Range, which also counts under ``framing_data_out_of_range``)."""
AUTH_FAILED = "auth_failed"
"""A DH-HMAC-CHAP transaction failed (wrong secret or protocol error)."""
AUTH_TIMEOUT = "auth_timeout"
"""A queue closed: it did not authenticate within its KATO (``auth_timeout`` without one)."""
RDMA_RECV_BUDGET = "rdma_recv_budget"
"""An RDMA connection rejected: its receive buffers would pass ``rdma_recv_total``."""

FRAMING = {int(fes): f"framing_{fes.name.lower()}" for fes in TermReqFes}
"""Framing errors (connection terminated with a C2HTermReq), by Fatal Error Status."""

_CONNECT_PREFIX = "connect_"


def connect_refused(status: int) -> str:
    """The reason of a Connect refused with ``status``: its status name, ``connect_`` first
    (``connect_invalid_host``, ``connect_command_sequence_error``)."""
    label = status_label(status)
    return label if label.startswith(_CONNECT_PREFIX) else _CONNECT_PREFIX + label


REASONS: tuple[str, ...] = (
    CONNECTIONS_TOTAL, CONNECTIONS_PER_HOST, HELLO_TIMEOUT, PDU_TIMEOUT, KEEP_ALIVE_TIMEOUT,
    COMMAND_POOL_EXHAUSTED, R2T_BUDGET_WAIT, INCAPSULE_TOO_LARGE, AUTH_FAILED, AUTH_TIMEOUT, RDMA_RECV_BUDGET,
    *FRAMING.values(),
)
"""The reasons known in advance; a refused Connect adds its own (:func:`connect_refused`)."""


class Rejections:
    """Refusals by reason since the target started; only ever grow."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
