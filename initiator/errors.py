"""Why a host command or connection failed: the exceptions every host layer raises and the
callers (FUSE mount, daemon, CLI) tell apart. A module of their own, below the controller and
the transports, so that neither imports the other for them."""

from __future__ import annotations

from protocol.status import MORE, describe


class NvmeError(Exception):
    """The target completed a command with a non-zero status (``status``: see protocol.status,
    without the More bit, which ``more`` keeps: a status compares equal to its Status member
    whether or not the target logged it; ``dw0``: the completion's DW0, which for some statuses
    says more, e.g. Connect's IATTR; ``io``: it answered an NVM I/O command, which names some
    command-specific statuses otherwise than a Fabrics command does)."""

    def __init__(self, status: int, what: str = "command", dw0: int = 0, io: bool = False) -> None:
        super().__init__(f"{what} failed: {describe(status, io)}")
        self.status = status & ~MORE
        self.more = bool(status & MORE)
        self.dw0 = dw0


class QueueLost(ConnectionError):
    """The connection carrying a command went away before it completed (and the reconnect
    policy gave up on it)."""


class ConnectError(ConnectionError):
    """Connecting failed for a reason worth one clear line to a user."""
