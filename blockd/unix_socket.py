"""A root-only Unix stream socket server: the daemons' control sockets (initiator and target).

The socket is created under umask 077 and then chmod 600, so no other user can connect even for
the moment between bind and chmod; its directory is made 700 when missing. A stale socket file
from a previous run is replaced.
"""

from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable

ClientCallback = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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
