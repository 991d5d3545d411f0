"""Shared helpers for the core tests: free ports, a target on real sockets, a raw NVMe/TCP client.

Everything runs on 127.0.0.1 with ports picked by binding port 0 and releasing it (the target's
listeners take a fixed port number). Async tests are plain sync tests calling :func:`run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from target.config import parse
from initiator.controller import ConnectParams, Controller
from protocol.constants import SglId
from protocol.fabrics import CONNECT_COMMAND, CONNECT_DATA
from protocol.layout import field_offset
from protocol.nvme import CQE_FAST, build_sgl_data_block, build_sqe
from protocol.tcp import IC_REQ, PduType, crc32c
from target.service import TargetService

NQN = "nqn.2026-11.io.blockd:test"
NQN2 = "nqn.2026-11.io.blockd:other"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(coro: Any, timeout: float = 60.0) -> Any:
    """Run one test coroutine with an overall timeout."""
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(guarded())


def ns(path: Path | str, nsid: int = 1, size: int = 8 << 20, block_size: int = 512,
       read_only: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"nsid": nsid, "path": str(path), "size": size, "block_size": block_size}
    if read_only:
        d["read_only"] = True
    return d


def sub(nqn: str = NQN, namespaces: list[dict[str, Any]] | None = None, **kw: Any) -> dict[str, Any]:
    d = {"nqn": nqn, "serial": kw.pop("serial", "BLOCKDTEST0001"), "model": kw.pop("model", "blockd test"),
         "namespace": namespaces or []}
    d.update(kw)
    return d


def config(ports: list[int], subsystems: list[dict[str, Any]], control: str = "",
           metrics: dict[str, Any] | None = None, target: dict[str, Any] | None = None) -> Any:
    """A target configuration; no control socket unless ``control`` names one (tests run side
    by side and must not share the default path). ``target``: the ``[target]`` table (limits)."""
    raw = {"port": [{"transport": "tcp", "address": "127.0.0.1", "port": p} for p in ports],
           "subsystem": subsystems, "control": {"socket": control}}
    if metrics is not None:
        raw["metrics"] = metrics
    if target is not None:
        raw["target"] = target
    return parse(raw, "test")


@contextlib.asynccontextmanager
async def serving(cfg: Any, open_replica: Any = None) -> AsyncIterator[TargetService]:
    """A started target service; ``open_replica`` reaches replicas (``initiator.replica.open_remote``)."""
    service = TargetService(cfg, open_replica)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def params(port: int, nqn: str = NQN, **kw: Any) -> ConnectParams:
    kw.setdefault("hostnqn", HOSTNQN)
    kw.setdefault("nr_io_queues", 2)
    kw.setdefault("connect_timeout", 3.0)
    kw.setdefault("command_timeout", 10.0)
    return ConnectParams(traddr="127.0.0.1", subnqn=nqn, trsvcid=port, **kw)


async def connect(port: int, nqn: str = NQN, **kw: Any) -> Controller:
    return await Controller.connect(params(port, nqn, **kw))


def fill_file(path: Path, size: int, seed: int = 7) -> bytes:
    """A backing file full of a recognisable pattern (so stray writes show)."""
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


# -- a raw NVMe/TCP client for hostile bytes ---------------------------------------------------------


def icreq(pfv: int = 0, hpda: int = 0, dgst: int = 0, plen: int = 128, hlen: int = 128) -> bytes:
    raw = bytearray(IC_REQ.build(dict(pdu_type=PduType.IC_REQ, flags=0, hlen=128, pdo=0, plen=128,
                                      pfv=pfv, hpda=hpda, dgst=dgst, maxr2t=0)))
    raw[2] = hlen
    raw[4:8] = plen.to_bytes(4, "little")
    return bytes(raw)


def capsule(sqe: bytes, data: bytes = b"", hdgst: bool = False, ddgst: bool = False) -> bytes:
    """A CapsuleCmd PDU (in-capsule data when ``data``)."""
    flags = (1 if hdgst else 0) | (2 if ddgst and data else 0)
    hd = 4 if hdgst else 0
    dd = 4 if ddgst and data else 0
    pdo = 72 + hd if data else 0
    plen = 72 + hd + len(data) + dd
    header = struct.pack("<BBBBI", PduType.CAPSULE_CMD, flags, 72, pdo, plen) + sqe
    out = header
    if hdgst:
        out += crc32c(header).to_bytes(4, "little")
    out += data
    if dd:
        out += crc32c(data).to_bytes(4, "little")
    return out


def h2c_data(cid: int, ttag: int, offset: int, data: bytes, last: bool = True) -> bytes:
    return struct.pack("<BBBBIHHIII", PduType.H2C_DATA, 4 if last else 0, 24, 24, 24 + len(data),
                       cid, ttag, offset, len(data), 0) + data


def incapsule_sgl(length: int, offset: int = 0) -> bytes:
    return build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, offset, length)


def transport_sgl(length: int) -> bytes:
    return build_sgl_data_block(SglId.TRANSPORT_DATA_BLOCK, 0, length)


def connect_sqe(cid: int = 0, qid: int = 0, sqsize: int = 31, kato: int = 0, recfmt: int = 0,
                length: int = 1024, cattr: int = 0) -> bytes:
    sqe = bytearray(build_sqe(0x7F, cid, dptr=incapsule_sgl(length)))
    sqe[field_offset(CONNECT_COMMAND, "cattr")] = cattr
    sqe[4] = 0x01
    sqe[40:42] = recfmt.to_bytes(2, "little")
    sqe[42:44] = qid.to_bytes(2, "little")
    sqe[44:46] = sqsize.to_bytes(2, "little")
    sqe[48:52] = kato.to_bytes(4, "little")
    return bytes(sqe)


def connect_data(nqn: str = NQN, hostnqn: str = HOSTNQN, cntlid: int = 0xFFFF) -> bytes:
    return CONNECT_DATA.build(dict(hostid=bytes(16), cntlid=cntlid, subnqn=nqn, hostnqn=hostnqn))


def prop_sqe(cid: int, get: bool, offset: int, size8: bool = False, value: int = 0) -> bytes:
    sqe = bytearray(build_sqe(0x7F, cid, dptr=transport_sgl(0)))
    sqe[4] = 0x04 if get else 0x00
    sqe[40] = 1 if size8 else 0
    sqe[44:48] = offset.to_bytes(4, "little")
    sqe[48:56] = value.to_bytes(8, "little")
    return bytes(sqe)


@dataclass
class RawPdu:
    ptype: int
    flags: int
    header: bytes
    data: bytes


@dataclass
class RawConn:
    """A bare NVMe/TCP connection driven byte by byte."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    cids: int = 0
    pending: list[RawPdu] = field(default_factory=list)

    @classmethod
    async def open(cls, port: int) -> RawConn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, raw: bytes) -> None:
        self.writer.write(raw)

    async def recv(self, timeout: float = 5.0) -> RawPdu | None:
        """The next PDU, or None when the target closed the connection."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(8), timeout)
        except asyncio.IncompleteReadError:
            return None
        except ConnectionResetError:
            return None
        ptype, flags, hlen, _pdo, plen = struct.unpack("<BBBBI", head)
        rest = await asyncio.wait_for(self.reader.readexactly(plen - 8), timeout)
        return RawPdu(ptype, flags, head + rest[:hlen - 8], rest[hlen - 8:])

    async def closed(self, timeout: float = 5.0) -> bool:
        """True once the target has closed its side (EOF), with nothing more sent."""
        try:
            rest = await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionResetError:
            return True
        return rest == b""

    async def initialize(self, dgst: int = 0) -> RawPdu:
        self.send(icreq(dgst=dgst))
        resp = await self.recv()
        assert resp is not None and resp.ptype == PduType.IC_RESP
        return resp

    async def command(self, sqe: bytes, data: bytes = b"", timeout: float = 5.0) -> tuple[int, int, int, bytes]:
        """Send one capsule; returns (status word, dw0, cid, C2H data) from the response."""
        self.send(capsule(sqe, data))
        got = b""
        while True:
            pdu = await self.recv(timeout)
            assert pdu is not None, "connection closed instead of a completion"
            if pdu.ptype == PduType.C2H_DATA:
                got += pdu.data
                continue
            assert pdu.ptype == PduType.CAPSULE_RESP, pdu
            dw0, _dw1, _sqhd, _sqid, cid, status = CQE_FAST.unpack_from(pdu.header, 8)
            return status, dw0, cid, got

    async def connect_admin(self, nqn: str = NQN, hostnqn: str = HOSTNQN, kato: int = 0) -> int:
        status, dw0, _, _ = await self.command(connect_sqe(kato=kato), connect_data(nqn, hostnqn))
        assert status == 0, hex(status)
        return dw0 & 0xFFFF

    async def enable(self) -> None:
        status, *_ = await self.command(prop_sqe(1, False, 0x14, value=0x00460001))
        assert status == 0, hex(status)

    async def connect_io(self, cntlid: int, qid: int = 1, nqn: str = NQN) -> None:
        status, _, _, _ = await self.command(connect_sqe(qid=qid, sqsize=127), connect_data(nqn, cntlid=cntlid))
        assert status == 0, hex(status)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def raw_admin(port: int, nqn: str = NQN) -> tuple[RawConn, int]:
    """A raw, connected and enabled admin queue; returns it and its controller id."""
    conn = await RawConn.open(port)
    await conn.initialize()
    cntlid = await conn.connect_admin(nqn)
    await conn.enable()
    return conn, cntlid


async def raw_io(port: int, nqn: str = NQN) -> tuple[RawConn, RawConn]:
    """A raw admin queue plus a raw connected I/O queue 1 of the same controller."""
    admin, cntlid = await raw_admin(port, nqn)
    io = await RawConn.open(port)
    await io.initialize()
    await io.connect_io(cntlid)
    return admin, io


def file_blocks(path: Path) -> int:
    return os.stat(path).st_blocks


async def until(cond: Any, timeout: float = 5.0) -> None:
    """Wait until ``cond()`` is true (target-side teardown follows the TCP close)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def comparable_counters(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A counters snapshot without the timings (they differ from run to run): what two twins'
    runs of the same commands must agree on, with how many commands were timed."""
    return {k: v for k, v in snapshot.items() if k not in ("latency_ns", "buckets")} | {
        "timed": sum(snapshot["buckets"])}


class SyncCounter:
    """``os.fdatasync`` replaced by a wrapper that counts calls per descriptor (it runs in the
    event loop's executor threads, hence the lock); with ``fail``, each call is counted and
    raises that error instead of syncing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: OSError | None = None) -> None:
        self.calls: dict[int, int] = {}
        self._lock = threading.Lock()
        real = os.fdatasync

        def counting(fd: int) -> None:
            if fail is None:
                real(fd)
            with self._lock:
                self.calls[fd] = self.calls.get(fd, 0) + 1
            if fail is not None:
                raise fail
        monkeypatch.setattr(os, "fdatasync", counting)

    def of(self, service: Any, nsid: int) -> int:
        fd = service.target.subsystems[NQN].namespaces[nsid].backend.fd
        return self.calls.get(fd, 0)
