"""What the daemon as a whole lets its hosts hold: connections, and write data buffers.

Per-queue bounds (unsent replies, a queue's own write buffers, the hello and PDU timeouts) live
with the transport connection; these two are shared by every connection of every port, so that
many queues, or many hosts, cannot add up to more than the configured total (issue 12).
"""

from __future__ import annotations

from typing import Callable

from target.rejections import CONNECTIONS_PER_HOST, CONNECTIONS_TOTAL, Rejections


class DataBudget:
    """Bytes of host data buffers held at once by all queues together.

    A queue that cannot get its share now leaves a ``wake`` callback and asks again when
    another queue gives bytes back (in the order they asked): new writes wait, nothing fails.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: dict[Callable[[], None], None] = {}
        """Callbacks of the queues waiting, in the order they asked (a dict: each once)."""

    def take(self, nbytes: int, wake: Callable[[], None]) -> bool:
        """Hold ``nbytes`` if the budget has them; else remember ``wake`` and say no."""
        if self.used + nbytes > self.limit:
            self._waiting[wake] = None
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """``nbytes`` are free again: every waiting queue asks again, first come first."""
        self.used -= nbytes
        if self._waiting:
            waiting, self._waiting = self._waiting, {}
            for wake in waiting:
                wake()

    def forget(self, wake: Callable[[], None]) -> None:
        """A queue that was waiting is gone."""
        self._waiting.pop(wake, None)


class ConnectionCount:
    """Connections open now, in all and per source address, against their maxima."""

    def __init__(self, max_total: int, max_per_host: int, rejections: Rejections) -> None:
        self.max_total = max_total
        self.max_per_host = max_per_host
        self.rejections = rejections
        self.total = 0
        self.by_host: dict[str, int] = {}

    def admit(self, host: str) -> bool:
        """Count a new connection from ``host``, or say no when a maximum is reached."""
        n = self.by_host.get(host, 0)
        if self.total >= self.max_total or n >= self.max_per_host:
            self.rejections.add(CONNECTIONS_TOTAL if self.total >= self.max_total else CONNECTIONS_PER_HOST)
            return False
        self.total += 1
        self.by_host[host] = n + 1
        return True

    def release(self, host: str) -> None:
        """A connection :meth:`admit` counted has closed."""
        self.total -= 1
        n = self.by_host[host] - 1
        if n:
            self.by_host[host] = n
        else:
            del self.by_host[host]
