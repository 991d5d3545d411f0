"""The initiator daemon's control protocol over a local Unix socket.

Each request is one JSON line; each reply starts with one JSON line ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. Bulk data travels raw right after the header line: a
``write`` request is followed by ``length`` bytes, a successful ``read`` reply by ``length``
bytes. Data moves in :data:`CHUNK`-sized pieces so memory stays bounded for any size.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Iterator

DEFAULT_SOCKET = "/run/blockd/initiator.sock"
CHUNK = 1 << 20


class ControlError(Exception):
    """The daemon refused a request; the message is meant for the user as is."""


def socket_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get("BLOCKD_INITIATOR_SOCKET", DEFAULT_SOCKET)


class ControlClient:
    """Blocking client used by blockctl (one request per connection)."""

    def __init__(self, path: str | None = None, timeout: float | None = 120.0,
                 daemon: str = "initiator") -> None:
        """``daemon``: whose socket this is (``initiator``, ``target``), for the messages; a
        ``path`` of None is the initiator's (:func:`socket_path`)."""
        self.path = path if daemon != "initiator" else socket_path(path)
        self.daemon = daemon
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except FileNotFoundError:
            raise ControlError(f"the {daemon} daemon is not running (no socket at {self.path}; "
                               f"start it with 'blockd {daemon}')") from None
        except PermissionError:
            raise ControlError(f"permission denied on {self.path} (the control socket is root-only)") from None
        except ConnectionRefusedError:
            raise ControlError(f"the {daemon} daemon is not answering on {self.path}") from None
        self._rbuf = self.sock.makefile("rb")

    def send(self, request: dict[str, Any], payload: Iterator[bytes] | None = None) -> None:
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        if payload is not None:
            for chunk in payload:
                self.sock.sendall(chunk)

    def reply(self) -> dict[str, Any]:
        line = self._rbuf.readline()
        if not line:
            raise ControlError(f"the {self.daemon} daemon closed the connection")
        msg = json.loads(line)
        if not msg.get("ok"):
            raise ControlError(msg.get("error", "request failed"))
        return msg

    def read_exact(self, n: int) -> bytes:
        data = self._rbuf.read(n)
        if len(data) != n:
            raise ControlError(f"the {self.daemon} daemon closed the connection mid-transfer")
        return data

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.send(request)
        return self.reply()

    def close(self) -> None:
        self._rbuf.close()
        self.sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
