"""The target core without sockets: raw SQEs into a TargetQueue, states and statuses out."""

from __future__ import annotations

import asyncio

from protocol.constants import DISCOVERY_NQN
from protocol.nvme import CQE_FAST, build_sqe
from protocol.status import Status, to_wire
from target.backend import MemoryBackend
from target.queue import TargetQueue
from target.request import RequestState
from target.subsystem import Namespace, Subsystem
from target.target import PortInfo, Target

from .conftest import HOSTNQN, NQN, connect_data, connect_sqe, incapsule_sgl, prop_sqe, transport_sgl

BLOCKS = 64


def make_target() -> tuple[Target, MemoryBackend]:
    target = Target(max_io_queues=2)
    target.add_port(PortInfo(1, "tcp", "127.0.0.1", "4420"))
    sub = Subsystem(NQN, serial="SANSIO", model="m")
    backend = MemoryBackend(BLOCKS * 512)
    sub.add_namespace(Namespace(1, backend, 512, False, NQN))
    target.add_subsystem(sub)
    return target, backend


def new_queue(target: Target, closed: list[int]) -> TargetQueue:
    return TargetQueue(target, "tcp", 1, 8192, lambda: closed.append(1))


async def complete(queue: TargetQueue, sqe: bytes, data: bytes | None = None) -> tuple[int, int, bytes | None]:
    """Drive one request through every state; returns (wire status, dw0, data sent to the host)."""
    req = queue.submit(sqe, memoryview(data) if data is not None else None)
    seen = [req.state]
    if req.state is RequestState.NEED_DATA:
        req.data = bytearray(data)  # as a transport does
        queue.data_received(req)
        seen.append(req.state)
    out = None
    if req.state is RequestState.EXECUTING:
        await queue.execute(req)
        seen.append(req.state)
        if req.state is RequestState.SENDING_DATA:
            out = bytes(req.data)
            queue.data_sent(req)
            seen.append(req.state)
    assert req.state is RequestState.COMPLETING, seen
    cqe = queue.completion(req)
    assert req.state is RequestState.DONE
    dw0, _, _, _, cid, status = CQE_FAST.unpack_from(cqe)
    assert cid == req.cid
    return status, dw0, out


async def admin_and_io() -> tuple[Target, MemoryBackend, TargetQueue, TargetQueue]:
    target, backend = make_target()
    closed: list[int] = []
    admin = new_queue(target, closed)
    status, cntlid, _ = await complete(admin, connect_sqe(kato=5000), connect_data())
    assert status == 0 and cntlid >= 1
    assert (await complete(admin, prop_sqe(1, False, 0x14, value=0x00460001)))[0] == 0
    io = new_queue(target, closed)
    status, dw0, _ = await complete(io, connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid))
    assert status == 0 and dw0 == cntlid
    return target, backend, admin, io


def rw_sqe(opc: int, cid: int, slba: int, nlb: int, sgl: bytes, nsid: int = 1, flags: int = 0x40) -> bytes:
    return build_sqe(opc, cid, flags=flags, nsid=nsid, dptr=sgl, cdw10=slba & 0xFFFFFFFF,
                     cdw11=slba >> 32, cdw12=nlb - 1)


def test_write_needs_data_then_read_sends_data() -> None:
    async def main() -> None:
        target, backend, admin, io = await admin_and_io()
        payload = bytes(range(256)) * 8  # 4 blocks
        req = io.submit(rw_sqe(0x01, 5, 10, 4, transport_sgl(len(payload))))
        assert req.state is RequestState.NEED_DATA
        req.data = bytearray(payload)  # as a transport does
        io.data_received(req)
        assert req.state is RequestState.EXECUTING
        await io.execute(req)
        assert req.state is RequestState.COMPLETING
        cqe = io.completion(req)
        assert req.state is RequestState.DONE
        assert CQE_FAST.unpack_from(cqe)[4:] == (5, 0)
        assert backend.data[10 * 512:14 * 512] == payload

        req = io.submit(rw_sqe(0x02, 0xA007, 10, 4, transport_sgl(len(payload))))
        assert req.state is RequestState.EXECUTING
        await io.execute(req)
        assert req.state is RequestState.SENDING_DATA
        assert bytes(req.data) == payload
        io.data_sent(req)
        assert req.state is RequestState.COMPLETING
        _, _, _, sqid, cid, status = CQE_FAST.unpack_from(io.completion(req))
        assert (sqid, cid, status) == (1, 0xA007, 0)  # the CID comes back bit-exact

        # In-capsule write: straight to EXECUTING.
        req = io.submit(rw_sqe(0x01, 6, 0, 1, incapsule_sgl(512)), memoryview(b"\x5a" * 512))
        assert req.state is RequestState.EXECUTING
        await io.execute(req)
        io.completion(req)
        assert backend.data[:512] == b"\x5a" * 512
        await target.close()
    asyncio.run(main())


def test_validation_failures_go_straight_to_completing() -> None:
    async def main() -> None:
        target, backend, admin, io = await admin_and_io()
        before = bytes(backend.data)
        cases = [
            (rw_sqe(0x02, 1, BLOCKS - 1, 2, transport_sgl(1024)), Status.LBA_RANGE),
            (rw_sqe(0x02, 2, 0, 1, transport_sgl(512), nsid=9), Status.INVALID_NS),
            (rw_sqe(0x02, 3, 0, 2, transport_sgl(512)), Status.SGL_INVALID_DATA_LENGTH),
            (rw_sqe(0x02, 4, 0, 1, transport_sgl(512), flags=0x00), Status.INVALID_FIELD),
            (rw_sqe(0x02, 5, 0, 1, transport_sgl(512), flags=0x41), Status.INVALID_FIELD),
            (rw_sqe(0x01, 6, 0, 1, incapsule_sgl(512, offset=4)), Status.SGL_INVALID_OFFSET),
            (build_sqe(0x7E, 7, nsid=1, dptr=transport_sgl(0)), Status.INVALID_OPCODE),
            (build_sqe(0x7C, 8, nsid=1, dptr=transport_sgl(0)), Status.INVALID_OPCODE),
        ]
        for sqe, want in cases:
            req = io.submit(sqe, memoryview(b"\0" * 512))
            assert req.state is RequestState.COMPLETING, (sqe[0], req)
            status = CQE_FAST.unpack_from(io.completion(req))[5]
            assert status == to_wire(want), (hex(status), want)
        assert bytes(backend.data) == before
        await target.close()
    asyncio.run(main())


def test_commands_before_connect_and_before_enable() -> None:
    async def main() -> None:
        target, _ = make_target()
        q = new_queue(target, [])
        # Not connected: an admin opcode is Invalid Opcode (nvmet_parse_connect_cmd).
        status, _, _ = await complete(q, build_sqe(0x06, 1, dptr=transport_sgl(4096), cdw10=1))
        assert status == to_wire(Status.INVALID_OPCODE)
        # Connected but CC.EN = 0: Command Sequence Error.
        status, _, _ = await complete(q, connect_sqe(), connect_data())
        assert status == 0
        status, _, _ = await complete(q, build_sqe(0x06, 2, dptr=transport_sgl(4096), cdw10=1))
        assert status == to_wire(Status.COMMAND_SEQUENCE_ERROR)
        # A second Connect on the same queue.
        status, _, _ = await complete(q, connect_sqe(), connect_data())
        assert status == to_wire(Status.COMMAND_SEQUENCE_ERROR)
        # Enable, then Identify works and returns 4096 bytes with our CNTLID at byte 78.
        assert (await complete(q, prop_sqe(3, False, 0x14, value=0x00460001)))[0] == 0
        status, dw0, _ = await complete(q, prop_sqe(4, True, 0x1C))
        assert status == 0 and dw0 & 1
        status, _, data = await complete(q, build_sqe(0x06, 5, dptr=transport_sgl(4096), cdw10=1))
        assert status == 0 and len(data) == 4096
        assert int.from_bytes(data[78:80], "little") == next(iter(target.controllers))
        await target.close()
    asyncio.run(main())


def test_connect_checks_and_unknown_host() -> None:
    async def main() -> None:
        target, _ = make_target()
        target.subsystems[NQN].allow_any_host = False
        target.subsystems[NQN].hosts = {"nqn.2014-08.org.nvmexpress:uuid:allowed"}
        cases = [
            (connect_sqe(recfmt=1), connect_data(), Status.CONNECT_INCOMPATIBLE_FORMAT, None),
            (connect_sqe(sqsize=0), connect_data(), Status.CONNECT_INVALID_PARAMETERS, 44),
            (connect_sqe(), connect_data(cntlid=1), Status.CONNECT_INVALID_PARAMETERS, (1 << 16) | 16),
            (connect_sqe(), connect_data(nqn="nqn.2026-11.io.blockd:nope"),
             Status.CONNECT_INVALID_PARAMETERS, (1 << 16) | 256),
            (connect_sqe(), connect_data(hostnqn=HOSTNQN), Status.CONNECT_INVALID_HOST, None),
            (connect_sqe(qid=1), connect_data(cntlid=1), Status.CONNECT_INVALID_PARAMETERS, (1 << 16) | 16),
        ]
        for sqe, data, want, dw0_want in cases:
            q = new_queue(target, [])
            status, dw0, _ = await complete(q, sqe, data)
            assert status == to_wire(want), (hex(status), want)
            if dw0_want is not None:
                assert dw0 == dw0_want
            assert q.controller is None
        # Connect data shorter than 1024 bytes.
        q = new_queue(target, [])
        req = q.submit(connect_sqe(length=512), memoryview(connect_data()[:512]))
        await q.execute(req)
        assert CQE_FAST.unpack_from(q.completion(req))[5] == to_wire(Status.SGL_INVALID_DATA_LENGTH)
        assert not target.controllers
        await target.close()
    asyncio.run(main())


def test_properties_and_discovery_identify() -> None:
    async def main() -> None:
        target, _ = make_target()
        q = new_queue(target, [])
        assert (await complete(q, connect_sqe(), connect_data(nqn=DISCOVERY_NQN)))[0] == 0
        status, cap, _ = await complete(q, prop_sqe(1, True, 0x00, size8=True))
        assert status == 0 and cap & 0xFFFF == 127
        for off, size8 in ((0x00, False), (0x08, True), (0x20, False), (0x1000, False)):
            status, _, _ = await complete(q, prop_sqe(2, True, off, size8=size8))
            assert status == to_wire(Status.INVALID_FIELD), (off, size8)
        status, _, _ = await complete(q, prop_sqe(3, False, 0x1C, value=1))  # CSTS is read-only
        assert status == to_wire(Status.INVALID_FIELD)
        assert (await complete(q, prop_sqe(4, False, 0x14, value=0x00460001)))[0] == 0
        status, _, data = await complete(q, build_sqe(0x06, 5, dptr=transport_sgl(4096), cdw10=1))
        assert status == 0 and data[111] == 2  # CNTRLTYPE discovery
        assert data[768:768 + len(DISCOVERY_NQN)] == DISCOVERY_NQN.encode()
        # A discovery controller has no namespaces.
        status, _, _ = await complete(q, build_sqe(0x06, 6, nsid=1, dptr=transport_sgl(4096), cdw10=0))
        assert status == to_wire(Status.INVALID_FIELD)
        await target.close()
    asyncio.run(main())
