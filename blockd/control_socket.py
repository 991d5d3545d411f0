"""The daemons' control sockets (initiator and target): a root-only Unix socket and its
request loop.

The socket is created under umask 077 and then chmod 600, so no other user can connect even for
the moment between bind and chmod; its directory is made 700 when missing. A stale socket file
from a previous run is replaced.

Each connection carries one request, a JSON line ``{"op": "<verb>", ...arguments}``, answered
by one JSON line ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}`` (a daemon may send
raw data after its reply line: the initiator's ``read``).
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Awaitable, Callable

ClientCallback = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Dispatch = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""(verb, arguments) -> the reply's fields, or None when it wrote its reply itself."""


class RequestError(Exception):
    """A request the daemon refuses, with a message for the user."""


async def listen_private(path: str, client: ClientCallback, limit: int = 1 << 16) -> asyncio.base_events.Server:
    """Serve ``client`` for each connection on the Unix socket ``path`` (mode 600)."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    old = os.umask(0o077)
    try:
        server = await asyncio.start_unix_server(client, path, limit=limit)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def remove(path: str) -> None:
    """Remove the socket file at shutdown (already gone is fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _refuse(writer: asyncio.StreamWriter, message: str) -> None:
    writer.write(json.dumps({"ok": False, "error": message}).encode() + b"\n")


async def serve_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, dispatch: Dispatch,
                        refusals: tuple[type[BaseException], ...], log: Any) -> None:
    """Read one request, answer it through ``dispatch``, close. :class:`RequestError`,
    ``ValueError``, ``TimeoutError`` and the daemon's own ``refusals`` become an error reply
    with their message; anything else is logged and answered as an internal error: the daemon
    keeps serving whatever one request does."""
    try:
        line = await reader.readline()
        if not line:
            return
        try:
            req = json.loads(line)
            op = req.pop("op")
        except (ValueError, KeyError, AttributeError, TypeError):
            raise RequestError("malformed request") from None
        reply = await dispatch(op, req)
        if reply is not None:
            writer.write(json.dumps({"ok": True, **reply}).encode() + b"\n")
    except (RequestError, ValueError, TimeoutError, *refusals) as exc:
        _refuse(writer, str(exc))
    except TypeError as exc:  # arguments the verb does not take
        _refuse(writer, f"bad request: {exc}")
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    except Exception as exc:
        log.exception("request failed")
        _refuse(writer, f"internal error: {exc}")
    finally:
        try:
            await writer.drain()
            writer.close()
        except ConnectionError:
            pass
