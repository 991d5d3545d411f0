"""The compiled host I/O half of NVMe/TCP (``initiator/_tcp_host_io.pyx``) against its Python
reference (``initiator/tcp_host_io.py``): the same commands submitted and the same random target
PDU streams (valid and mutated: unknown ids, data out of place, SUCCESS without LAST_PDU, R2Ts
for reads or beyond the data, error statuses, digests on and off, random chunking) must send the
same bytes, complete the same commands with the same status, fill the same buffers and end the
connection with the same error. Half the compiled twin's writes carry their data as the compiled
FUSE loop gives it, an ``InlineData`` (``initiator/_inline.pyx``) whose capsule is sent as one
``bytes``: the bytes sent must not change."""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest

from blockd import output, pdu_reader
from blockd.tcp_asyncio import PduProtocol
from blockd.tcp_pdu import PduWriter
from initiator import queue as py_queue, tcp_host_io
from initiator.tcp import _C2H_TYPES, TcpHostConnection
from protocol.commands import read_command, write_command
from protocol.nvme import CQE_FAST
from protocol.status import to_wire
from protocol.layout import field_offset
from protocol.tcp import DATA_PDU_HEADER, PduFlags, PduType

_compiled = pytest.importorskip("initiator._tcp_host_io", reason="compiled data plane not built")
_compiled_queue = pytest.importorskip("initiator._queue", reason="compiled data plane not built")
_compiled_output = pytest.importorskip("blockd._output", reason="compiled data plane not built")
_compiled_reader = pytest.importorskip("blockd._pdu_reader", reason="compiled data plane not built")
_inline = pytest.importorskip("initiator._inline", reason="compiled data plane not built")

_OWN = {k: v for k, v in TcpHostConnection.__dict__.items() if k not in ("__dict__", "__weakref__", "__doc__")}
"""The connection's own methods, put on each twin below (whichever base the module picked)."""
CONNECTIONS = {
    "python": type("PythonConnection", (tcp_host_io.TcpHostIo, PduProtocol), dict(_OWN)),
    "compiled": type("CompiledConnection", (_compiled.TcpHostIo, PduProtocol), dict(_OWN)),
}
QUEUES = {"python": py_queue, "compiled": _compiled_queue}
"""Each twin with its own command and queue classes, as the controller pairs them."""
BATCHERS = {"python": output.OutputBatcher, "compiled": _compiled_output.OutputBatcher}
READERS = {"python": pdu_reader.PduReader, "compiled": _compiled_reader.PduReader}
"""Each twin with its own reader and batcher (the compiled receive loop drives the compiled
reader from C), whichever the data plane picked for the connection."""
"""And with its own output batcher, as ``blockd.tcp_asyncio`` pairs them."""
BS = 512
_DATAL = field_offset(DATA_PDU_HEADER, "datal")


class _Transport:
    """Records every write (as bytes) and the close; never backlogged."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.sent.append(("write", bytes(data)))

    def writelines(self, bufs: list[Any]) -> None:
        self.sent.append(("writelines", b"".join(bytes(b) for b in bufs)))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.sent.append(("close", b""))
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0


class _Loop:
    """The event loop's ``call_soon``: the flushes that sends outside a hold schedule, run by
    the test where the loop would (after the submits)."""

    def __init__(self) -> None:
        self.ready: list[Any] = []

    def call_soon(self, callback: Any) -> None:
        self.ready.append(callback)

    def run_ready(self) -> None:
        ready, self.ready = self.ready, []
        for callback in ready:
            callback()


def _commands(rng: random.Random) -> list[tuple[bool, int]]:
    """(write, length) of the commands a stream starts with."""
    return [(rng.random() < 0.4, rng.choice([BS, 4 * BS, 16 * BS, 40 * BS])) for _ in range(rng.randrange(1, 6))]


def _stream(rng: random.Random, cmds: list[tuple[bool, int]], writer: PduWriter) -> bytes:
    """What a target might send: mostly the right answers, some of them wrong."""
    pdus: list[bytes] = []
    for cid, (write, length) in enumerate(cmds):
        if rng.random() < 0.1:
            cid = rng.choice([cid + 7, 200])  # an id never given
        if write and length > 8192 or rng.random() < 0.08:  # R2Ts (one wrong now and then)
            offset = 0
            while offset < length:
                n = min(rng.choice([length, 4096, 8192]), length - offset)
                if rng.random() < 0.05:
                    n = rng.choice([0, length])
                pdus.append(b"".join(writer.r2t(cid, rng.randrange(4), offset, n)))
                offset += max(n, 1)
        if not write or rng.random() < 0.08:  # C2HData, in pieces, the last with SUCCESS or not
            offset = 0
            success = rng.random() < 0.6
            while offset < length:
                n = min(rng.choice([length, BS, 8 * BS]), length - offset)
                last = offset + n == length
                flags = (PduFlags.LAST_PDU if last else 0) | (PduFlags.SUCCESS if last and success else 0)
                if rng.random() < 0.04:
                    flags = PduFlags.SUCCESS
                at = offset if rng.random() > 0.04 else offset + BS
                data = bytes([rng.randrange(256)]) * n
                pdu = bytearray(b"".join(bytes(b) for b in writer.data_pdu(PduType.C2H_DATA, cid, 0, at, data, flags)))
                if rng.random() < 0.04:  # DATAL not the data it carries
                    pdu[_DATAL:_DATAL + 4] = (n - BS).to_bytes(4, "little")
                pdus.append(bytes(pdu))
                offset += n
            if success:
                continue
        status = rng.choice([0, 0, 0, 0x0281, 0x4004])
        pdus.append(b"".join(writer.pdu(PduType.CAPSULE_RESP, CQE_FAST.pack(cid * 3, 7, 0, 1, cid, to_wire(status)))))
    rng.shuffle(pdus) if rng.random() < 0.1 else None
    raw = bytearray(b"".join(pdus))
    if rng.random() < 0.15 and raw:  # a flipped byte: a header field, or data under a digest
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    return bytes(raw)


def _run(kind: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    digests = rng.random() < 0.3
    cmds = _commands(rng)
    ended: list[str] = []
    HostCommand, HostQueue = QUEUES[kind].HostCommand, QUEUES[kind].HostQueue
    conn = CONNECTIONS[kind](HostQueue(1, 16), lambda _, exc: ended.append(str(exc)))
    transport, loop = _Transport(), _Loop()
    conn.transport = transport
    conn.out = BATCHERS[kind](transport, loop=loop)
    conn.reader = READERS[kind](_C2H_TYPES, max_data=1 << 22, place=conn._place)
    conn.get_buffer = conn.reader.get_buffer
    conn.maxh2cdata = rng.choice([4096, 8192])
    conn.reader.hdgst = conn.writer.hdgst = digests
    conn.reader.ddgst = conn.writer.ddgst = digests
    done: list[tuple[int, int, int, int, int, str]] = []
    buffers = []
    for write, length in cmds:
        buf = bytearray(rng.randbytes(length)) if write else bytearray(length)
        buffers.append(buf)
        sqe = write_command(1, 8, length // BS - 1) if write else read_command(1, 8, length // BS - 1)
        inline = rng.random() < 0.5 and kind == "compiled"
        out = (_inline.InlineData(buf) if inline else memoryview(buf)) if write else None
        cmd = HostCommand(sqe, out, None if write else memoryview(buf),
                          lambda c, exc: done.append((c.cid, c.status, c.dw0, c.dw1, c.transferred, repr(exc))))
        conn.submit(cmd)
    loop.run_ready()
    target = PduWriter()
    target.hdgst = target.ddgst = digests
    stream = _stream(rng, cmds, target)
    pos = 0
    while pos < len(stream) and not conn.closed:
        dest = conn.get_buffer(-1)
        n = min(len(dest), rng.choice([7, 100, 4096, len(stream)]), len(stream) - pos)
        dest[:n] = stream[pos:pos + n]
        conn.buffer_updated(n)
        pos += n
    loop.run_ready()
    return {"sent": transport.sent, "done": done, "buffers": buffers, "error": repr(conn.error),
            "closed": conn.closed, "pending": sorted(conn.queue.pending),
            "reader": (conn.reader.completed, conn.reader.copied)}


@pytest.mark.parametrize("seed", range(300))
def test_compiled_and_python_host_io_alike(seed: int) -> None:
    assert _run("compiled", seed) == _run("python", seed)


def test_the_streams_reach_every_outcome() -> None:
    """Some streams complete commands, some fail them with a status, some end the connection."""
    runs = [_run("python", seed) for seed in range(300)]
    assert any(r["done"] and not r["closed"] for r in runs)
    assert any(d[1] for r in runs for d in r["done"])
    errors = {r["error"].split(":")[1] if ":" in r["error"] else r["error"] for r in runs}
    assert len(errors) > 4, errors
    # R2T answers sent: a write after the submits' one that starts with an H2CData
    assert any(data[:1] == bytes([PduType.H2C_DATA]) for r in runs for _, data in r["sent"][1:])



class _KeepingTransport(_Transport):
    """Keeps what it is given, as uvloop does until it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def write(self, data: Any) -> None:
        super().write(data)
        self.kept.append(data)


def _write_sent(kind: str, data_out: Any, busy: bool) -> tuple[_KeepingTransport, bytes]:
    """What one write of ``data_out`` sends on a new connection of ``kind`` (with another
    command in flight first when ``busy``, so that its id is not 0)."""
    conn = CONNECTIONS[kind](QUEUES[kind].HostQueue(1, 16), lambda _, exc: None)
    transport, loop = _KeepingTransport(), _Loop()
    conn.transport = transport
    conn.out = BATCHERS[kind](transport, loop=loop)
    HostCommand = QUEUES[kind].HostCommand
    if busy:
        conn.submit(HostCommand(read_command(1, 0, 0), None, memoryview(bytearray(BS)), lambda c, e: None))
        loop.run_ready()
    before = len(transport.sent)
    conn.submit(HostCommand(write_command(1, 8, 1), data_out, None, lambda c, e: None))
    loop.run_ready()
    return transport, bytes(bytearray().join(data for _, data in transport.sent[before:]))  # a copy, not the object sent


def test_inline_data_is_sent_as_one_bytes_never_written_once_handed_out() -> None:
    """The capsule of an ``InlineData`` write is its own ``bytes``, header and SQE in front of
    the data; sent again while a transport still holds those bytes (a retry after a reconnect
    whose first send was not written yet), it is framed apart and the first bytes stay as they
    were; once nothing holds them, it is framed in place again."""
    data = bytes(range(256)) * 4
    inline = _inline.InlineData(data)
    first, sent = _write_sent("compiled", inline, False)
    assert sent == _write_sent("python", memoryview(data), False)[1]
    assert type(first.kept[-1]) is bytes and first.kept[-1] == sent  # one buffer: no join
    second, again = _write_sent("compiled", inline, True)
    assert again == _write_sent("python", memoryview(data), True)[1] != sent
    assert first.kept[-1] == sent, "bytes handed to a transport were written over"
    own = id(first.kept[-1])
    del first, second
    gc.collect()  # the connections' reference cycles
    third, last = _write_sent("compiled", inline, True)
    assert last == again and id(third.kept[-1]) == own
