"""sd_notify(3) over ``$NOTIFY_SOCKET``, in a few lines of our own (no libsystemd needed).

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op returning False, so the daemons
call these unconditionally.  Path sockets (``/run/systemd/notify``) and abstract sockets
(``@name``) are both supported.

    n = Notifier.from_env()
    n.ready("exporting 1 subsystem")      # READY=1 + STATUS=
    n.status("draining 3 commands")
    n.reloading(); ...; n.ready(...)      # RELOADING=1 + MONOTONIC_USEC, then READY=1
    n.stopping()
    n.start_watchdog()                    # WATCHDOG=1 from the running event loop every WATCHDOG_USEC/2
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import structlog

log = structlog.get_logger("blockd.sdnotify")


def _address(raw: str) -> str | bytes:
    if raw.startswith("@"):
        return "\0" + raw[1:]      # abstract namespace
    return raw


class Notifier:
    """A datagram sender to the service manager; every method returns whether it sent."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self.path = socket_path or None
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._watchdog_task: asyncio.Task[None] | None = None

    @classmethod
    def from_env(cls, unset: bool = False) -> Notifier:
        """From ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC``/``WATCHDOG_PID`` (see sd_watchdog_enabled(3)).

        ``unset`` removes the variables so that children do not inherit them.
        """
        path = os.environ.get("NOTIFY_SOCKET") or None
        wd: int | None = None
        raw_usec = os.environ.get("WATCHDOG_USEC")
        raw_pid = os.environ.get("WATCHDOG_PID")
        if raw_usec and raw_usec.isdigit() and int(raw_usec) > 0:
            if not raw_pid or (raw_pid.isdigit() and int(raw_pid) == os.getpid()):
                wd = int(raw_usec)
        if unset:
            for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(var, None)
        return cls(path, wd)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when not under systemd or on error."""
        if self.path is None:
            return False
        msg = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, _address(self.path))
            return True
        except OSError as exc:
            log.warning("sd_notify failed", socket=self.path, error=str(exc))
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def reloading(self, status: str | None = "reloading configuration") -> bool:
        # MONOTONIC_USEC is what Type=notify-reload (systemd 253+) wants; older systemd ignores it
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}",
                           *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = "stopping: draining in-flight I/O") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def mainpid(self, pid: int | None = None) -> bool:
        return self.notify(f"MAINPID={pid or os.getpid()}")

    # -- watchdog from the event loop -----------------------------------------------------------------

    def start_watchdog(self) -> asyncio.Task[None] | None:
        """Ping WATCHDOG=1 every WATCHDOG_USEC/2 from the *running* loop (call inside it).

        The pings come from a coroutine, so a loop that hangs (a blocking call, a busy callback)
        stops pinging and systemd kills and restarts the service.
        """
        if not self.enabled or not self.watchdog_usec or self._watchdog_task is not None:
            return None
        interval = self.watchdog_usec / 2 / 1e6

        async def pinger() -> None:
            while True:
                self.watchdog()
                await asyncio.sleep(interval)

        self._watchdog_task = asyncio.get_running_loop().create_task(pinger(), name="sd-watchdog")
        log.debug("watchdog pings started", interval_s=interval)
        return self._watchdog_task

    def stop_watchdog(self) -> None:
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            self._watchdog_task = None

    def close(self) -> None:
        self.stop_watchdog()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
