"""A TCP proxy on loopback between a primary and one replica, for partition tests: the
primary's replica address is the proxy's port, and the test cuts, heals and slows the link.

The proxy runs its own event loop on a thread, so that it keeps forwarding while the test
blocks (``blockctl`` calls, a host load on another loop). Three ways to fail the link:

* :meth:`Proxy.cut` with ``reset``: every connection is aborted (RST both ways) and new ones
  are accepted and aborted at once, as a peer whose host is down or a firewall that rejects;
* :meth:`Proxy.cut` with ``blackhole``: nothing is read or forwarded any more, nothing is closed
  (bytes wait in the sockets' buffers, as in a network that drops packets and TCP retransmits
  them); new connections are accepted and left silent. :meth:`Proxy.heal` then delivers what
  waited, in order, as retransmission does once a partition heals;
* :meth:`Proxy.slow`: every byte is forwarded ``delay`` seconds after it was read, in order
  (a replica that answers, but late).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

RESET = "reset"
BLACKHOLE = "blackhole"


class _Pipe:
    """One proxied connection: the primary's side and the replica's, a pump each way."""

    def __init__(self, proxy: Proxy, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.down_r, self.down_w = down_r, down_w
        self.up_w: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        proxy = self.proxy
        await proxy.flowing.wait()  # a connection made during a black hole goes nowhere until healed
        if proxy.mode == RESET:
            self.abort()
            return
        try:
            up_r, self.up_w = await asyncio.open_connection("127.0.0.1", proxy.target_port)
        except OSError:
            self.abort()
            return
        self.tasks = [asyncio.create_task(self._pump(self.down_r, self.up_w)),
                      asyncio.create_task(self._pump(up_r, self.down_w))]
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read, hold each chunk until its time (the delay when it was read), forward in order;
        while the link is black-holed neither read nor write. An end (EOF, or a reset) is passed
        on in its turn, after what was read before it, as a network delivers a FIN or RST after
        the segments sent before it."""
        proxy = self.proxy
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def forward() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await proxy.flowing.wait()
                if data is None:  # the sender reset the connection
                    writer.transport.abort()
                    return
                if not data:
                    writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(forward())
        try:
            while True:
                await proxy.flowing.wait()
                try:
                    data: bytes | None = await reader.read(1 << 16)
                except OSError:
                    data = None
                queue.put_nowait((time.monotonic() + proxy.delay, data))
                if not data:
                    break
            await sender
        except OSError:
            pass  # the receiving side is gone: nothing more to deliver this way
        finally:
            sender.cancel()

    def abort(self) -> None:
        for task in self.tasks:
            task.cancel()
        for w in (self.down_w, self.up_w):
            if w is not None and not w.transport.is_closing():
                w.transport.abort()
        self.proxy.pipes.discard(self)


class Proxy:
    """Listens on a free loopback port and forwards to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode: str | None = None
        """None while the link is whole, else :data:`RESET` or :data:`BLACKHOLE`."""
        self.delay = 0.0
        self.pipes: set[_Pipe] = set()
        """The connections open (changed on the proxy's thread only)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proxy", daemon=True)
        self._thread.start()
        self.flowing: asyncio.Event = self._call(self._make_event())
        self._server: asyncio.Server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = _Pipe(self, reader, writer)
        self.pipes.add(pipe)
        await pipe.run()

    def cut(self, mode: str = RESET) -> None:
        """Fail the link: :data:`RESET` aborts every connection, :data:`BLACKHOLE` stops all
        traffic and closes nothing."""
        assert mode in (RESET, BLACKHOLE)

        async def cut() -> None:
            self.mode = mode
            self.flowing.clear()
            if mode == RESET:
                for pipe in list(self.pipes):
                    pipe.abort()
                self.flowing.set()  # connections still come: each is aborted on arrival
        self._call(cut())

    def heal(self) -> None:
        """The link is whole again (what a black hole held is delivered now)."""

        async def heal() -> None:
            self.mode = None
            self.flowing.set()
        self._call(heal())

    def slow(self, delay: float) -> None:
        """Forward every byte read from now on ``delay`` seconds late (0: at once again)."""
        self.delay = delay

    def open_pipes(self) -> set[_Pipe]:
        """The connections open now (to wait for their end with :meth:`wait_gone`)."""

        async def snapshot() -> set[_Pipe]:
            return set(self.pipes)
        return self._call(snapshot())

    def wait_gone(self, pipes: set[_Pipe], timeout: float) -> None:
        """Until every connection of ``pipes`` ended: all it carried was delivered, its ends
        were passed on and both sides closed it."""
        deadline = time.monotonic() + timeout
        while left := pipes & self.open_pipes():
            assert time.monotonic() < deadline, f"{len(left)} old connections still open"
            time.sleep(0.05)

    def close(self) -> None:
        async def close() -> None:
            self._server.close()
            for pipe in list(self.pipes):
                pipe.abort()
        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
