"""A host that ends an I/O queue and at once connects a new one with the same QID gets it
(``TargetTransport.settle``, target/tcp.py): the old queue's end may not have reached the core yet
when the new Connect is served, and the Connect must not then fail with Command Sequence Error
for a queue that is already dead. A queue whose host is still there keeps its QID
(test_hostile.py's ``connect-io-qid-taken``: Command Sequence Error, as nvmet)."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from protocol.nvme import build_sqe

from .conftest import RawConn, capsule, config, fill_file, free_port, ns, raw_admin, run, serving, sub, transport_sgl

SIZE = 1 << 20


def _read(cid: int) -> bytes:
    return build_sqe(0x02, cid, nsid=1, dptr=transport_sgl(4096), cdw10=0, cdw12=7)


async def _io_queue(port: int, cntlid: int) -> RawConn:
    io = await RawConn.open(port)
    await io.initialize()
    await io.connect_io(cntlid)  # asserts SUCCESS
    return io


@pytest.mark.parametrize("end", ["close", "close behind a command", "reset"])
def test_a_queue_whose_host_left_is_settled_by_the_next_connect(tmp_path: Path, end: str) -> None:
    """The host ends I/O queue 1 while the target is not reading that socket, so the end is
    still unread when the host connects QID 1 again (what happens when the loop reads the end
    later in the same round as the new Connect, or the queue's thread has seen it and waits for
    the GIL): the Connect succeeds, the old connection is released once (the connection count),
    and the new queue serves. ``end``: a FIN, a FIN behind a command never read, an RST."""
    port = free_port()
    path = tmp_path / "vol.img"
    fill_file(path, SIZE)
    cfg = config([port], [sub(namespaces=[ns(path, size=SIZE)])], target={"threaded_queues": False})

    async def main() -> None:
        async with serving(cfg) as service:
            target = service.target
            admin, cntlid = await raw_admin(port)
            old = await _io_queue(port, cntlid)
            ctrl = target.controllers[cntlid]
            conn = ctrl.queues[1].transport
            conn.transport.pause_reading()  # the loop reads nothing more of the old socket
            if end == "close behind a command":
                old.send(capsule(_read(1)))
            elif end == "reset":
                sock = old.writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await old.close()
            await asyncio.sleep(0.05)  # the host's end is in the target's socket, unread
            assert not conn.transport.is_closing() and ctrl.queues[1].transport is conn
            new = await _io_queue(port, cntlid)
            assert ctrl.queues[1].transport is not conn and conn.transport.is_closing()
            status, _, cid, data = await new.command(_read(2))
            assert (status, cid, len(data)) == (0, 2, 4096)
            await asyncio.sleep(0.05)  # asyncio's own connection_lost for the old one has run
            assert target.connections.total == 2  # admin and new: the old one released once
            await new.close()
            await admin.close()

    run(main(), timeout=30)
