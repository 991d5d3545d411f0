"""What the daemon as a whole lets its hosts hold: connections, write data buffers, RDMA
receive buffers and replies waiting to be sent.

Per-queue bounds (unsent replies, a queue's own write buffers, the hello and PDU timeouts) live
with the transport connection; these are shared by every connection of every port, so that
many queues, or many hosts, cannot add up to more than the configured total (issue 12).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Protocol

from target.rejections import CONNECTIONS_PER_HOST, CONNECTIONS_TOTAL, Rejections


class DataBudget:
    """Bytes of host data buffers held at once by all queues together.

    A queue that cannot get its share now leaves a ``wake`` callback and asks again when
    another queue gives bytes back (in the order they asked): new writes wait, nothing fails.

    The queues' threads (``target/_tcp_io.pyx``: R2T writes served on a queue's thread) take
    and give bytes too, so the count changes under a lock; the wake-ups (which send R2Ts on
    other connections' transports) run only on the event loop: a thread gives with
    :meth:`free` and has the loop run ``give(0)`` when someone waits.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._waiting: dict[Callable[[], None], None] = {}
        """Callbacks of the queues waiting, in the order they asked (a dict: each once)."""

    def take(self, nbytes: int, wake: Callable[[], None]) -> bool:
        """Hold ``nbytes`` if the budget has them; else remember ``wake`` and say no."""
        with self._lock:
            if self.used + nbytes > self.limit:
                self._waiting[wake] = None
                return False
            self.used += nbytes
            return True

    def try_take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` if the budget has them now, without waiting for them."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def free(self, nbytes: int) -> bool:
        """``nbytes`` are free again, nobody woken: True if queues wait for bytes (then
        ``give(0)`` wakes them, on the loop)."""
        with self._lock:
            self.used -= nbytes
            return bool(self._waiting)

    def give(self, nbytes: int) -> None:
        """``nbytes`` are free again: every waiting queue asks again, first come first."""
        with self._lock:
            self.used -= nbytes
            waiting, self._waiting = self._waiting, {}
        for wake in waiting:
            wake()

    def forget(self, wake: Callable[[], None]) -> None:
        """A queue that was waiting is gone."""
        with self._lock:
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


class Unsending(Protocol):
    """A queue whose replies may wait in its socket (the NVMe/TCP connection)."""

    def unsent(self) -> int:
        """Bytes of replies handed to the socket and not yet sent."""

    def hold_reading(self, held: bool) -> None:
        """Stop (True) or resume (False) reading commands because of the daemon-wide total."""


class UnsentTotal:
    """Replies waiting to be sent, over every queue, against ``max_unsent_total``.

    Each queue bounds its own backlog (``max_unsent``), but a thousand queues of 4 MiB each are
    4 GiB. A queue reports its backlog when its output leaves a non-empty socket buffer
    (:meth:`note`); the socket gives no signal when a backlog shrinks, so while anything is counted
    a timer re-reads every counted queue each ``POLL`` seconds. The count can only be high between
    two reads, never low, so the cap holds. Past the cap each queue that adds to the backlog stops
    reading commands; all of them read again once the total is below three quarters of it.
    While the cap is passed (``over``) queues hand each read's data to the socket at once, so
    that a queue not yet held adds at most one reply before its backlog shows.
    """

    POLL = 0.05
    """Seconds between re-reads of the counted backlogs: only while there are any."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.over = False
        """``total`` is past ``limit``."""
        self.counted: dict[Unsending, int] = {}
        self.held: set[Unsending] = set()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, queue: Unsending) -> None:
        """``queue`` just left replies unsent: count them, and hold it if the total is passed."""
        n = queue.unsent()
        self.total += n - self.counted.get(queue, 0)
        self.counted[queue] = n
        self.over = self.total > self.limit
        if self.over and queue not in self.held:
            self.held.add(queue)
            queue.hold_reading(True)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.POLL, self._poll)

    def forget(self, queue: Unsending) -> None:
        """``queue`` is gone (its replies with it)."""
        self.total -= self.counted.pop(queue, 0)
        self.held.discard(queue)
        self._poll_done()

    def _poll(self) -> None:
        self._timer = None
        counted = self.counted
        for queue in list(counted):
            n = queue.unsent()
            if n:
                counted[queue] = n
            else:
                del counted[queue]
        self.total = sum(counted.values())
        self._poll_done()
        if counted and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.POLL, self._poll)

    def _poll_done(self) -> None:
        """Release the held queues once the total fell below three quarters of the cap."""
        self.over = self.total > self.limit
        if self.held and self.total <= self.limit * 3 // 4:
            held, self.held = self.held, set()
            for queue in held:
                queue.hold_reading(False)
        if not self.counted and self._timer is not None:
            self._timer.cancel()
            self._timer = None
