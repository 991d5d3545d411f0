"""A scripted NVMe/TCP peer on loopback, for tests that need the far end to misbehave on cue.

Our own target and host are correct by construction, so neither can show how the other copes
with a peer that sends what the protocol forbids. A :class:`PeerConnection` frames whole PDUs
with ``blockd.tcp_pdu`` (so what it receives is checked as our ends check it) and sends any
bytes a test builds, valid or not. :class:`ScriptedTarget` plays a controller well enough for
``initiator.controller.Controller`` to connect (admin queue, Identify, one namespace in memory)
and hands every I/O command to a test's script, which may answer it correctly (``execute``),
answer it wrongly, or drop the connection. A hostile *host* is a ``PeerConnection``
with ``receives=HOST_RECEIVES`` opened with :meth:`PeerConnection.open`.

Every field is read and written through the ``protocol/`` layouts, never by byte index.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from blockd.tcp_pdu import PduReader, PduWriter
from protocol.commands import SET_FEATURES_COMMAND
from protocol.constants import (
    CC_EN, CC_SHN_NORMAL, CSTS_RDY, CSTS_SHST_COMPLETE, AdminOpcode, Cns, FabricsType, FeatureId, IoOpcode,
    Property, SglId,
)
from protocol.fabrics import CONNECT_COMMAND, FABRICS_COMMAND, PROPERTY_COMMAND
from protocol.identify import ACTIVE_NS_LIST, IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE, IDENTIFY_SIZE
from protocol.layout import FixedLayout, fixed_layout
from protocol.nvme import CQE_FAST, GET_LOG_PAGE_COMMAND, IDENTIFY_COMMAND, IO_COMMAND_FAST, SQE_FAST
from protocol.status import Status, to_wire
from protocol.tcp import (
    COMMON_HEADER_FAST, COMMON_HEADER_SIZE, DATA_PDU_HEADER_FAST, IC_REQ, IC_RESP, TERM_REQ_HEADER, PduFlags,
    PduType,
)

HOST_RECEIVES = frozenset({PduType.IC_RESP, PduType.C2H_TERM_REQ, PduType.CAPSULE_RESP, PduType.C2H_DATA,
                           PduType.R2T})
TARGET_RECEIVES = frozenset({PduType.IC_REQ, PduType.H2C_TERM_REQ, PduType.CAPSULE_CMD, PduType.H2C_DATA})
MAX_DATA = 4 << 20
TERM_REQ_FAST = fixed_layout(TERM_REQ_HEADER)
_CONNECT = fixed_layout(CONNECT_COMMAND)
_FABRICS = fixed_layout(FABRICS_COMMAND)
_PROPERTY = fixed_layout(PROPERTY_COMMAND)
_IDENTIFY = fixed_layout(IDENTIFY_COMMAND)
_SET_FEATURES = fixed_layout(SET_FEATURES_COMMAND)
_GET_LOG_PAGE = fixed_layout(GET_LOG_PAGE_COMMAND)


@dataclass(frozen=True)
class RawPdu:
    """One received PDU, copied out of the reader's buffer."""

    ptype: int
    flags: int
    header: bytes
    data: bytes

    def fields(self, layout: FixedLayout) -> dict[str, Any]:
        """The header's fields by name, e.g. ``pdu.fields(DATA_PDU_HEADER_FAST)["cccid"]``."""
        return layout.as_dict(self.header)


def pdu_bytes(ptype: int, rest: bytes, data: bytes = b"", flags: int = 0, *, hlen: int | None = None,
              pdo: int | None = None, plen: int | None = None) -> bytes:
    """A PDU without digests whose common header says what the test wants (defaults: correct)."""
    hlen = COMMON_HEADER_SIZE + len(rest) if hlen is None else hlen
    pdo = (COMMON_HEADER_SIZE + len(rest) if data else 0) if pdo is None else pdo
    plen = COMMON_HEADER_SIZE + len(rest) + len(data) if plen is None else plen
    return COMMON_HEADER_FAST.pack(ptype, flags, hlen, pdo, plen) + rest + data


def data_header_rest(cccid: int, ttag: int, offset: int, length: int) -> bytes:
    """The data-PDU header after its common header (C2HData, H2CData, R2T)."""
    return DATA_PDU_HEADER_FAST.pack(0, 0, 0, 0, 0, cccid, ttag, offset, length)[COMMON_HEADER_SIZE:]


class PeerConnection:
    """One TCP connection of a scripted peer: whole PDUs in (checked by ``PduReader``), any
    bytes out. ``receives`` says which end it plays (:data:`TARGET_RECEIVES` or
    :data:`HOST_RECEIVES`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 receives: frozenset[int]) -> None:
        self.reader = reader
        self.writer = writer
        self.pdus = PduReader(receives, MAX_DATA)
        self.framing = PduWriter()
        """Builds correct PDUs with the negotiated digests (hostile ones are built by hand)."""
        self._inbox: collections.deque[RawPdu] = collections.deque()

    @classmethod
    async def open(cls, port: int, receives: frozenset[int] = HOST_RECEIVES) -> PeerConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, receives)

    def digests(self, hdgst: bool, ddgst: bool) -> None:
        self.pdus.hdgst = self.framing.hdgst = hdgst
        self.pdus.ddgst = self.framing.ddgst = ddgst

    def send(self, raw: bytes | list[bytes | memoryview]) -> None:
        if self.writer.is_closing():
            return
        if isinstance(raw, list):
            self.writer.writelines(raw)
        else:
            self.writer.write(raw)

    async def recv(self, timeout: float = 5.0) -> RawPdu | None:
        """The next PDU, or None once the peer closed (or reset) the connection."""
        while not self._inbox:
            try:
                chunk = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                return None
            for pdu in self.pdus.feed(chunk):
                data = b"" if pdu.data is None else bytes(pdu.data)
                self._inbox.append(RawPdu(pdu.pdu_type, pdu.flags, bytes(pdu.header), data))
        return self._inbox.popleft()

    async def answered(self, timeout: float) -> bool:
        """Whether the peer sent a PDU, or closed, within ``timeout``; a PDU stays to be received."""
        try:
            pdu = await self.recv(timeout)
        except asyncio.TimeoutError:
            return False
        if pdu is not None:
            self._inbox.appendleft(pdu)
        return True  # after the close, ``recv`` keeps answering None

    async def closed(self, timeout: float = 5.0) -> bool:
        """True once the peer has closed its side, with no PDU sent before that."""
        return await self.recv(timeout) is None

    def close(self) -> None:
        """Drop the connection (from this side, as a crashing or hostile peer would)."""
        self.writer.close()


@dataclass
class IoCommand:
    """An I/O command as the scripted target received it."""

    sqe: bytes
    data: bytes
    """In-capsule data (empty when the data comes by R2T, or for a read)."""
    cid: int
    opcode: int
    slba: int
    nblocks: int
    length: int
    """Bytes the SGL describes."""
    in_capsule: bool


IoScript = Callable[["TargetConnection", IoCommand], Awaitable[None]]


class TargetConnection(PeerConnection):
    """One host connection to a :class:`ScriptedTarget` (the admin queue or an I/O queue)."""

    def __init__(self, target: ScriptedTarget, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer, TARGET_RECEIVES)
        self.target = target
        self.qid = -1
        self.ttag = 0

    # -- answers a script builds from ---------------------------------------------------------------

    def respond(self, cid: int, status: int = 0, dw0: int = 0, dw1: int = 0) -> None:
        cqe = CQE_FAST.pack(dw0, dw1, 0, max(self.qid, 0), cid, to_wire(status))
        self.send(self.framing.pdu(PduType.CAPSULE_RESP, cqe))

    def c2h_data(self, cid: int, offset: int, data: bytes, flags: int = PduFlags.LAST_PDU) -> None:
        self.send(self.framing.data_pdu(PduType.C2H_DATA, cid, 0, offset, data, flags))

    def r2t(self, cid: int, offset: int, length: int) -> int:
        """Ask for ``length`` bytes at ``offset``; returns the transfer tag."""
        self.ttag += 1
        self.send(self.framing.r2t(cid, self.ttag, offset, length))
        return self.ttag

    async def h2c_data(self, cid: int, length: int) -> bytes:
        """The ``length`` bytes the host sends for an R2T, checked for order and LAST_PDU.
        Capsules the host sent meanwhile are kept, in order, for the serving loop."""
        got = bytearray()
        later: list[RawPdu] = []
        while len(got) < length:
            pdu = await self.recv()
            assert pdu is not None, "connection closed before the data"
            if pdu.ptype == PduType.CAPSULE_CMD:
                later.append(pdu)
                continue
            assert pdu.ptype == PduType.H2C_DATA, pdu
            head = pdu.fields(DATA_PDU_HEADER_FAST)
            assert head["cccid"] == cid and head["datao"] == len(got), head
            got += pdu.data
            assert bool(pdu.flags & PduFlags.LAST_PDU) == (len(got) == length), head
        self._inbox.extendleft(reversed(later))
        return bytes(got)

    async def execute(self, cmd: IoCommand) -> None:
        """What a correct controller does with ``cmd`` (the default script)."""
        target = self.target
        start = cmd.slba * target.block_size
        end = start + cmd.length
        if cmd.opcode == IoOpcode.READ:
            self.c2h_data(cmd.cid, 0, bytes(target.disk[start:end]))
        elif cmd.opcode == IoOpcode.WRITE:
            if cmd.in_capsule:
                data = cmd.data
            else:
                self.r2t(cmd.cid, 0, cmd.length)
                data = await self.h2c_data(cmd.cid, cmd.length)
            target.disk[start:end] = data
        elif cmd.opcode != IoOpcode.FLUSH:
            self.respond(cmd.cid, Status.INVALID_OPCODE)
            return
        self.respond(cmd.cid)

    # -- the controller's side of the conversation ---------------------------------------------------

    async def serve(self) -> None:
        icreq = await self.recv()
        if icreq is None or icreq.ptype != PduType.IC_REQ:
            return
        dgst = IC_REQ.parse(icreq.header).dgst
        self.send(IC_RESP.build(dict(pdu_type=PduType.IC_RESP, flags=0, hlen=128, pdo=0, plen=128, pfv=0,
                                     cpda=0, dgst=dgst, maxh2cdata=self.target.maxh2cdata)))
        self.digests(bool(dgst & 1), bool(dgst & 2))
        while (pdu := await self.recv(timeout=3600)) is not None:
            if pdu.ptype != PduType.CAPSULE_CMD:
                self.target.unexpected.append(pdu)
                continue
            sqe = pdu.header[COMMON_HEADER_SIZE:]
            if self.qid > 0 and SQE_FAST.as_dict(sqe)["opcode"] != IoOpcode.FABRICS:
                await self.target.script(self, self._io(sqe, pdu.data))
            else:
                self._admin(sqe, pdu.data)

    def _io(self, sqe: bytes, data: bytes) -> IoCommand:
        f = IO_COMMAND_FAST.as_dict(sqe)
        in_capsule = f["sgl_id"] == SglId.DATA_BLOCK_OFFSET
        return IoCommand(sqe, data, f["cid"], f["opcode"], f["slba"], f["nlb"] + 1, f["sgl_length"], in_capsule)

    def _admin(self, sqe: bytes, data: bytes) -> None:
        target = self.target
        head = SQE_FAST.as_dict(sqe)
        cid, opcode = head["cid"], head["opcode"]
        if opcode == AdminOpcode.FABRICS:
            fctype = _FABRICS.as_dict(sqe)["fctype"]
            if fctype == FabricsType.CONNECT:
                self.qid = _CONNECT.as_dict(sqe)["qid"]
                target.connects.append(self.qid)
                self.respond(cid, dw0=target.cntlid)
            elif fctype == FabricsType.PROPERTY_GET:
                value = target.property(_PROPERTY.as_dict(sqe)["offset"])
                self.respond(cid, dw0=value & 0xFFFFFFFF, dw1=value >> 32)
            elif fctype == FabricsType.PROPERTY_SET:
                prop = _PROPERTY.as_dict(sqe)
                if prop["offset"] == Property.CC:
                    target.cc = prop["value"]
                self.respond(cid)
            else:
                self.respond(cid, Status.INVALID_OPCODE)
        elif opcode == AdminOpcode.IDENTIFY:
            self.c2h_data(cid, 0, target.identify(_IDENTIFY.as_dict(sqe)["cns"]))
            self.respond(cid)
        elif opcode == AdminOpcode.SET_FEATURES and _SET_FEATURES.as_dict(sqe)["fid"] == FeatureId.NUMBER_OF_QUEUES:
            self.respond(cid, dw0=_SET_FEATURES.as_dict(sqe)["cdw11"])  # all asked for
        elif opcode == AdminOpcode.GET_LOG_PAGE:
            f = _GET_LOG_PAGE.as_dict(sqe)
            length = (((f["numdu"] << 16) | f["numdl"]) + 1) * 4
            page = target.log_pages.get(f["lid"], b"")[f["lpo"]:f["lpo"] + length]
            self.c2h_data(cid, 0, page.ljust(length, b"\0"))
            self.respond(cid)
        elif opcode == AdminOpcode.KEEP_ALIVE:
            self.respond(cid)
        else:
            self.respond(cid, Status.INVALID_OPCODE)


class ScriptedTarget:
    """A controller on 127.0.0.1 with one namespace held in ``disk``; each I/O command goes to
    ``script(conn, cmd)`` (default: :meth:`TargetConnection.execute`). ``connections`` lists
    every connection accepted, in order; ``connects`` the QID of every Connect."""

    cntlid = 1
    nsid = 1

    def __init__(self, size: int = 1 << 20, block_size: int = 512, queue_depth: int = 32,
                 inline: int = 8192, maxh2cdata: int = 1 << 20, script: IoScript | None = None) -> None:
        self.disk = bytearray(size)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.inline = inline
        self.maxh2cdata = maxh2cdata
        self.script: IoScript = script or TargetConnection.execute
        self.cc = 0
        self.log_pages: dict[int, bytes] = {}
        """Get Log Page answers by log page id (what the page holds from offset 0)."""
        self.connections: list[TargetConnection] = []
        self.connects: list[int] = []
        self.unexpected: list[RawPdu] = []
        """PDUs other than capsules the serving loop was given (a script reads its own)."""
        self.errors: list[Exception] = []
        """What a connection's serving loop or script raised (a test asserts it is empty)."""
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ScriptedTarget:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Close the listener and every connection (a target that went away)."""
        if self._server is not None:
            self._server.close()
        for conn in self.connections:
            conn.close()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = TargetConnection(self, reader, writer)
        self.connections.append(conn)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await conn.serve()
        except ConnectionError:
            pass  # the host went away: what it saw is the test's business
        except Exception as exc:  # a script's own check, or a bug here: the test looks at ``errors``
            self.errors.append(exc)
        finally:
            self._tasks.discard(task)
            conn.close()

    def property(self, offset: int) -> int:
        if offset == Property.CAP:
            return (self.queue_depth - 1) | (1 << 24)  # MQES, CAP.TO 500 ms
        if offset == Property.CSTS:
            ready = CSTS_RDY if self.cc & CC_EN else 0
            return ready | (CSTS_SHST_COMPLETE if self.cc & CC_SHN_NORMAL else 0)
        return 0

    def identify(self, cns: int) -> bytes:
        if cns == Cns.CONTROLLER:
            ident = IDENTIFY_CONTROLLER.parse(bytes(IDENTIFY_SIZE))
            ident.update(dict(cntlid=self.cntlid, maxcmd=self.queue_depth, nn=1, sqes=0x66, cqes=0x44,
                              ioccsz=(64 + self.inline) // 16, iorcsz=1, subnqn="nqn.2026-11.io.blockd:scripted"))
            return IDENTIFY_CONTROLLER.build(ident)
        if cns == Cns.ACTIVE_NS_LIST:
            return ACTIVE_NS_LIST.build([self.nsid] + [0] * (IDENTIFY_SIZE // 4 - 1))
        if cns == Cns.NAMESPACE:
            ns = IDENTIFY_NAMESPACE.parse(bytes(IDENTIFY_SIZE))
            blocks = len(self.disk) // self.block_size
            ns.update(dict(nsze=blocks, ncap=blocks, nuse=blocks))
            ns.lbaf[0].lbads = self.block_size.bit_length() - 1
            return IDENTIFY_NAMESPACE.build(ns)
        return bytes(IDENTIFY_SIZE)
