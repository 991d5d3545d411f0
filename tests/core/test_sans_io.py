"""The target core without sockets: raw SQEs into a TargetQueue over a fake transport.

The fake transport only records what the core asks of it (fetch the host's data, send a
response); with a MemoryBackend every command runs to its end inside ``submit`` or
``data_ready``, so these tests drive the whole core (Connect, Identify, I/O, errors) by plain
calls. An event loop is running only because Connect starts the target's keep-alive reaper.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protocol.constants import DISCOVERY_NQN, SglId, TransportType
from protocol.identify import IDENTIFY_CONTROLLER
from protocol.fabrics import IPO_CONNECT_CNTLID, IPO_CONNECT_SQSIZE, IPO_CONNECT_SUBNQN
from protocol.logpage import (
    DISCOVERY_ENTRY, DISCOVERY_ENTRY_SIZE, DISCOVERY_HEADER, DISCOVERY_HEADER_SIZE, ERROR_LOG_ENTRY,
    ERROR_LOG_ENTRY_SIZE, TSAS_RDMA,
)
from protocol.nvme import CQE_FAST, build_sgl_data_block, build_sqe
from protocol.status import MORE, Status, to_wire
from target.backend import MemoryBackend
from target.queue import TargetQueue
from target.request import IllegalTransition, Request, RequestState
from target.subsystem import Namespace, Subsystem
from target.target import PortInfo, Target
from target.transport import TransportInfo

from .conftest import HOSTNQN, NQN, connect_data, connect_sqe, incapsule_sgl, prop_sqe, transport_sgl

BLOCKS = 64
FAKE = TransportInfo(
    name="fake", trtype=TransportType.TCP, data_sgl_ids=frozenset({SglId.TRANSPORT_DATA_BLOCK}),
    keyed_sgls=False, admin_inline=8192, io_inline=16384, max_transfer=1 << 19, sgls=0x00100001,
    tsas=bytes(256))
"""Sizes unlike both real transports, so Identify visibly takes them from the transport."""


class FakeTransport:
    """What a transport does for the core, in memory: the host's data for a command waits in
    ``host_data`` (by CID) and is handed over at once, or on :meth:`deliver` when ``hold``."""

    info = FAKE
    read_buffer = None

    def __init__(self) -> None:
        self.queue: TargetQueue | None = None
        self.host_data: dict[int, bytes] = {}
        self.hold = False
        self.fetching: list[Request] = []
        self.responses: list[tuple[int, int, int, bytes | None]] = []
        """(cid, wire status, dw0, data sent before the CQE) per response, in order."""
        self.closed = False

    def fetch_data(self, req: Request) -> None:
        self.fetching.append(req)
        if not self.hold:
            self.deliver(req)

    def deliver(self, req: Request) -> None:
        self.fetching.remove(req)
        req.data = bytearray(self.host_data.pop(req.cid))
        self.queue.data_ready(req)

    def queue_response(self, req: Request) -> None:
        dw0, _, _, _, cid, status = CQE_FAST.unpack_from(req.cqe)
        assert cid == req.cid
        self.responses.append((cid, status, dw0, bytes(req.reply) if req.reply is not None else None))
        self.queue.response_sent(req)

    def close(self) -> None:
        self.closed = True

    def settle(self) -> bool:
        return False  # a fake connection ends only when a test closes it


def make_target(backend: Any = None) -> tuple[Target, Any]:
    """A target with one subsystem whose namespace 1 is ``backend`` (a RAM one by default)."""
    target = Target(max_io_queues=2)
    target.add_port(PortInfo(1, "tcp", "127.0.0.1", "4420"))
    sub = Subsystem(NQN, serial="SANSIO", model="m")
    backend = backend if backend is not None else MemoryBackend(BLOCKS * 512)
    sub.add_namespace(Namespace(1, backend, 512, NQN))
    target.add_subsystem(sub)
    return target, backend


def new_queue(target: Target) -> tuple[TargetQueue, FakeTransport]:
    transport = FakeTransport()
    transport.queue = TargetQueue(target, transport, 1)
    return transport.queue, transport


def complete(queue: TargetQueue, sqe: bytes, data: bytes | None = None,
             incapsule: bool = True) -> tuple[int, int, bytes | None]:
    """Submit one command; it must be answered before ``submit`` returns (nothing waits).
    Returns (wire status, dw0, data sent to the host)."""
    transport: FakeTransport = queue.transport  # type: ignore[assignment]
    before = len(transport.responses)
    if data is not None and not incapsule:
        transport.host_data[int.from_bytes(sqe[2:4], "little")] = data
    queue.submit(sqe, memoryview(data) if data is not None and incapsule else None)
    assert len(transport.responses) == before + 1, transport.responses[before:]
    _, status, dw0, out = transport.responses[-1]
    return status, dw0, out


def admin_and_io(backend: Any = None) -> tuple[Target, Any, TargetQueue, TargetQueue]:
    target, backend = make_target(backend)
    admin, _ = new_queue(target)
    status, cntlid, _ = complete(admin, connect_sqe(kato=5000), connect_data())
    assert status == 0 and cntlid >= 1
    assert complete(admin, prop_sqe(1, False, 0x14, value=0x00460001))[0] == 0
    io, _ = new_queue(target)
    status, dw0, _ = complete(io, connect_sqe(qid=1, sqsize=127), connect_data(cntlid=cntlid))
    assert status == 0 and dw0 == cntlid
    return target, backend, admin, io


def rw_sqe(opc: int, cid: int, slba: int, nlb: int, sgl: bytes, nsid: int = 1, flags: int = 0x40,
           cdw12_extra: int = 0) -> bytes:
    return build_sqe(opc, cid, flags=flags, nsid=nsid, dptr=sgl, cdw10=slba & 0xFFFFFFFF,
                     cdw11=slba >> 32, cdw12=(nlb - 1) | cdw12_extra)


def run(test: Any) -> None:
    """Run a synchronous test body with a loop running (Connect starts the reaper)."""
    async def main() -> None:
        target = test()
        await target.close()
    asyncio.run(main())


def test_write_fetched_then_read_returned() -> None:
    def body() -> Target:
        target, backend, admin, io = admin_and_io()
        transport: FakeTransport = io.transport  # type: ignore[assignment]
        payload = bytes(range(256)) * 8  # 4 blocks
        transport.hold = True
        transport.host_data[5] = payload
        io.submit(rw_sqe(0x01, 5, 10, 4, transport_sgl(len(payload))))
        [req] = transport.fetching
        assert req.state is RequestState.NEED_DATA and not transport.responses[2:]
        assert backend.data[10 * 512:14 * 512] == bytes(len(payload))  # nothing ran yet
        transport.deliver(req)
        assert req.state is RequestState.DONE
        assert transport.responses[-1] == (5, 0, 0, None)
        assert backend.data[10 * 512:14 * 512] == payload

        status, _, out = complete(io, rw_sqe(0x02, 0xA007, 10, 4, transport_sgl(len(payload))))
        assert status == 0 and out == payload
        assert transport.responses[-1][0] == 0xA007  # the CID comes back bit-exact

        # In-capsule write: runs inside submit, no fetch.
        assert complete(io, rw_sqe(0x01, 6, 0, 1, incapsule_sgl(512)), b"\x5a" * 512)[0] == 0
        assert backend.data[:512] == b"\x5a" * 512
        assert not transport.fetching
        return target
    run(body)


def test_failed_fetch_fails_the_command_and_writes_nothing() -> None:
    def body() -> Target:
        target, backend, admin, io = admin_and_io()
        transport: FakeTransport = io.transport  # type: ignore[assignment]
        transport.hold = True
        io.submit(rw_sqe(0x01, 9, 0, 1, transport_sgl(512)))
        [req] = transport.fetching
        io.data_failed(req)
        assert transport.responses[-1] == (9, to_wire(Status.DATA_TRANSFER_ERROR), 0, None)
        assert req.state is RequestState.DONE
        assert backend.data[:512] == bytes(512)
        return target
    run(body)


def test_illegal_transitions_raise() -> None:
    def body() -> Target:
        target, backend, admin, io = admin_and_io()
        transport: FakeTransport = io.transport  # type: ignore[assignment]
        transport.hold = True
        transport.host_data[3] = b"\1" * 512
        io.submit(rw_sqe(0x01, 3, 0, 1, transport_sgl(512)))
        [req] = transport.fetching
        transport.deliver(req)
        assert req.state is RequestState.DONE
        with pytest.raises(IllegalTransition):
            io.data_ready(req)  # data reported twice
        with pytest.raises(IllegalTransition):
            io.data_failed(req)
        with pytest.raises(IllegalTransition):
            io.response_sent(req)  # a response sent twice
        # a request still waiting for its data has no response to send
        io.submit(rw_sqe(0x01, 4, 0, 1, transport_sgl(512)))
        [waiting] = transport.fetching
        with pytest.raises(IllegalTransition):
            io.response_sent(waiting)
        assert waiting.state is RequestState.NEED_DATA
        return target
    run(body)


def test_flush_and_write_zeroes_reach_the_backend() -> None:
    def body() -> Target:
        target, backend, admin, io = admin_and_io()
        backend.data[:1024] = b"\xff" * 1024
        assert complete(io, build_sqe(0x00, 1, nsid=1, dptr=transport_sgl(0)))[0] == 0
        assert complete(io, build_sqe(0x00, 2, nsid=0xFFFFFFFF, dptr=transport_sgl(0)))[0] == 0
        assert complete(io, build_sqe(0x00, 3, nsid=7, dptr=transport_sgl(0)))[0] == to_wire(Status.INVALID_NS | MORE)
        assert complete(io, rw_sqe(0x08, 4, 1, 1, transport_sgl(0)))[0] == 0
        assert backend.data[:1024] == b"\xff" * 512 + bytes(512)
        return target
    run(body)


def test_validation_failures_answer_at_once() -> None:
    def body() -> Target:
        target, backend, admin, io = admin_and_io()
        transport: FakeTransport = io.transport  # type: ignore[assignment]
        before = bytes(backend.data)
        cases = [
            (rw_sqe(0x02, 1, BLOCKS - 1, 2, transport_sgl(1024)), Status.LBA_RANGE | MORE),
            (rw_sqe(0x02, 2, 0, 1, transport_sgl(512), nsid=9), Status.INVALID_NS | MORE),
            (rw_sqe(0x02, 3, 0, 2, transport_sgl(512)), Status.SGL_INVALID_DATA_LENGTH | MORE),
            (rw_sqe(0x02, 4, 0, 1, transport_sgl(512), flags=0x00), Status.INVALID_FIELD | MORE),
            (rw_sqe(0x02, 5, 0, 1, transport_sgl(512), flags=0x41), Status.INVALID_FIELD | MORE),
            (rw_sqe(0x01, 6, 0, 1, incapsule_sgl(512, offset=4)), Status.SGL_INVALID_OFFSET),
            (build_sqe(0x7E, 7, nsid=1, dptr=transport_sgl(0)), Status.INVALID_OPCODE | MORE),
            (build_sqe(0x7C, 8, nsid=1, dptr=transport_sgl(0)), Status.INVALID_OPCODE | MORE),
            # larger than this transport's max transfer (the fake's 512 KiB, not 1 MiB)
            (rw_sqe(0x01, 9, 0, 1025, transport_sgl(1025 * 512)), Status.SGL_INVALID_DATA_LENGTH | MORE),
            # a keyed SGL on a transport without keyed SGLs
            (rw_sqe(0x01, 10, 0, 1, build_sgl_data_block(SglId.KEYED_DATA_BLOCK, 0, 512)), Status.SGL_INVALID_TYPE),
        ]
        for sqe, want in cases:
            status, _, _ = complete(io, sqe, b"\0" * 512)
            assert status == to_wire(want), (sqe[0], hex(status), want)
        assert bytes(backend.data) == before and not transport.fetching
        return target
    run(body)


def test_commands_before_connect_and_before_enable() -> None:
    def body() -> Target:
        target, _ = make_target()
        q, _ = new_queue(target)
        # Not connected: an admin opcode is Invalid Opcode (nvmet_parse_connect_cmd).
        status, _, _ = complete(q, build_sqe(0x06, 1, dptr=transport_sgl(4096), cdw10=1))
        assert status == to_wire(Status.INVALID_OPCODE)
        # Connected but CC.EN = 0: Command Sequence Error.
        assert complete(q, connect_sqe(), connect_data())[0] == 0
        status, _, _ = complete(q, build_sqe(0x06, 2, dptr=transport_sgl(4096), cdw10=1))
        assert status == to_wire(Status.COMMAND_SEQUENCE_ERROR)
        # A second Connect on the same queue.
        status, _, _ = complete(q, connect_sqe(), connect_data())
        assert status == to_wire(Status.COMMAND_SEQUENCE_ERROR)
        # Enable, then Identify works and returns 4096 bytes with our CNTLID at byte 78.
        assert complete(q, prop_sqe(3, False, 0x14, value=0x00460001))[0] == 0
        status, dw0, _ = complete(q, prop_sqe(4, True, 0x1C))
        assert status == 0 and dw0 & 1
        status, _, data = complete(q, build_sqe(0x06, 5, dptr=transport_sgl(4096), cdw10=1))
        assert status == 0 and len(data) == 4096
        assert int.from_bytes(data[78:80], "little") == next(iter(target.controllers))
        # What the transport says it is: MDTS (byte 77), SGLS (536), IOCCSZ (1792).
        assert data[77] == 7  # 2^7 x 4 KiB = the fake's 512 KiB
        assert int.from_bytes(data[536:540], "little") == FAKE.sgls
        assert int.from_bytes(data[1792:1796], "little") == (64 + FAKE.io_inline) // 16
        # Identify with the wrong length is refused before it runs.
        status, _, _ = complete(q, build_sqe(0x06, 6, dptr=transport_sgl(512), cdw10=1))
        assert status == to_wire(Status.SGL_INVALID_DATA_LENGTH | MORE)
        return target
    run(body)


def test_property_set_with_data_changes_nothing() -> None:
    def body() -> Target:
        target, _ = make_target()
        q, _ = new_queue(target)
        assert complete(q, connect_sqe(), connect_data())[0] == 0
        ctrl = q.controller
        bad = bytearray(prop_sqe(1, False, 0x14, value=0x00460001))
        bad[24:40] = transport_sgl(8)  # a Property Set carries no data
        assert complete(q, bytes(bad))[0] == to_wire(Status.SGL_INVALID_DATA_LENGTH | MORE)
        assert ctrl.cc == 0 and not ctrl.ready
        bad = bytearray(prop_sqe(2, False, 0x14, size8=True, value=0x00460001))
        assert complete(q, bytes(bad))[0] == to_wire(Status.INVALID_FIELD | MORE)  # CC is 4 bytes
        assert ctrl.cc == 0
        assert complete(q, prop_sqe(3, False, 0x14, value=0x00460001))[0] == 0
        assert ctrl.ready
        return target
    run(body)


def test_connect_checks_and_unknown_host() -> None:
    def body() -> Target:
        target, _ = make_target()
        target.subsystems[NQN].allow_any_host = False
        target.subsystems[NQN].hosts = {"nqn.2014-08.org.nvmexpress:uuid:allowed"}
        cases = [
            (connect_sqe(recfmt=1), connect_data(), Status.CONNECT_INCOMPATIBLE_FORMAT, None),
            (connect_sqe(sqsize=0), connect_data(), Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SQSIZE),
            (connect_sqe(), connect_data(cntlid=1), Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_CNTLID),
            (connect_sqe(), connect_data(nqn="nqn.2026-11.io.blockd:nope"),
             Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_SUBNQN),
            (connect_sqe(), connect_data(hostnqn=HOSTNQN), Status.CONNECT_INVALID_HOST, None),
            (connect_sqe(qid=1), connect_data(cntlid=1), Status.CONNECT_INVALID_PARAMETERS, IPO_CONNECT_CNTLID),
        ]
        for sqe, data, want, dw0_want in cases:
            q, _ = new_queue(target)
            status, dw0, _ = complete(q, sqe, data)
            assert status == to_wire(want), (hex(status), want)
            if dw0_want is not None:
                assert dw0 == dw0_want
            assert q.controller is None
        # the named error locations are the spec's offsets
        assert (IPO_CONNECT_SQSIZE, IPO_CONNECT_CNTLID, IPO_CONNECT_SUBNQN) == (44, (1 << 16) | 16, (1 << 16) | 256)
        # Connect data shorter than 1024 bytes.
        q, _ = new_queue(target)
        status, _, _ = complete(q, connect_sqe(length=512), connect_data()[:512])
        assert status == to_wire(Status.SGL_INVALID_DATA_LENGTH)
        # Connect data fetched by the transport (not in the capsule) works the same way.
        target.subsystems[NQN].allow_any_host = True
        q, transport = new_queue(target)
        sqe = bytearray(connect_sqe(cid=7))
        sqe[24:40] = transport_sgl(1024)
        assert complete(q, bytes(sqe), connect_data(), incapsule=False)[0] == 0
        assert q.controller is not None and not transport.host_data
        return target
    run(body)


def test_properties_and_discovery_identify() -> None:
    def body() -> Target:
        target, _ = make_target()
        q, _ = new_queue(target)
        assert complete(q, connect_sqe(), connect_data(nqn=DISCOVERY_NQN))[0] == 0
        status, cap, _ = complete(q, prop_sqe(1, True, 0x00, size8=True))
        assert status == 0 and cap & 0xFFFF == 127
        for off, size8 in ((0x00, False), (0x08, True), (0x20, False), (0x1000, False)):
            status, _, _ = complete(q, prop_sqe(2, True, off, size8=size8))
            assert status == to_wire(Status.INVALID_FIELD | MORE), (off, size8)
        status, _, _ = complete(q, prop_sqe(3, False, 0x1C, value=1))  # CSTS is read-only
        assert status == to_wire(Status.INVALID_FIELD | MORE)
        assert complete(q, prop_sqe(4, False, 0x14, value=0x00460001))[0] == 0
        status, _, data = complete(q, build_sqe(0x06, 5, dptr=transport_sgl(4096), cdw10=1))
        assert status == 0 and data[111] == 2  # CNTRLTYPE discovery
        assert data[768:768 + len(DISCOVERY_NQN)] == DISCOVERY_NQN.encode()
        # A discovery controller has no namespaces.
        status, _, _ = complete(q, build_sqe(0x06, 6, nsid=1, dptr=transport_sgl(4096), cdw10=0))
        assert status == to_wire(Status.INVALID_FIELD | MORE)
        return target
    run(body)


def test_in_capsule_size_before_connect() -> None:
    """Until an I/O Connect a queue takes the transport's admin in-capsule size, unless the
    transport already knows the queue's kind (RDMA sizes its receives from the CM request's
    QID, and an I/O queue's Connect data comes in the capsule)."""
    class NoAdminInline(FakeTransport):
        info = TransportInfo(**{**FAKE.__dict__, "admin_inline": 0})

    def body() -> Target:
        target, _ = make_target()
        transport = NoAdminInline()
        q = transport.queue = TargetQueue(target, transport, 1)
        assert complete(q, connect_sqe(), connect_data())[0] == to_wire(Status.SGL_INVALID_OFFSET)
        transport = NoAdminInline()
        q = transport.queue = TargetQueue(target, transport, 1, inline_size=4096)
        assert complete(q, connect_sqe(), connect_data())[0] == 0
        return target
    run(body)


def discovery_page(target: Target, port_id: int, hostnqn: str = HOSTNQN) -> list[Any]:
    """The discovery log a host gets by asking on port ``port_id``: its entries, parsed."""
    transport = FakeTransport()
    q = transport.queue = TargetQueue(target, transport, port_id)
    assert complete(q, connect_sqe(), connect_data(nqn=DISCOVERY_NQN, hostnqn=hostnqn))[0] == 0
    assert complete(q, prop_sqe(1, False, 0x14, value=0x00460001))[0] == 0
    length = DISCOVERY_HEADER_SIZE + 4 * DISCOVERY_ENTRY_SIZE
    sqe = build_sqe(0x02, 2, dptr=transport_sgl(length), cdw10=0x70 | ((length // 4 - 1) << 16))
    status, _, page = complete(q, sqe)
    assert status == 0
    numrec = DISCOVERY_HEADER.parse(page).numrec
    return [DISCOVERY_ENTRY.parse(page[off:off + DISCOVERY_ENTRY_SIZE])
            for off in range(DISCOVERY_HEADER_SIZE, DISCOVERY_HEADER_SIZE + numrec * DISCOVERY_ENTRY_SIZE,
                             DISCOVERY_ENTRY_SIZE)]


def test_discovery_log_describes_each_port_by_its_transport() -> None:
    """TRTYPE and TSAS come from the transport the port's configuration names (the registry
    in target.transport), not from the core; each port's log lists that port only (as nvmet:
    a host that asked over TCP is not sent to an RDMA port, nor the reverse)."""
    def body() -> Target:
        target, _ = make_target()
        target.add_port(PortInfo(2, "rdma", "192.0.2.1", "4420"))
        tcp = {(e.portid, e.subnqn): e for e in discovery_page(target, 1)}
        assert set(tcp) == {(1, DISCOVERY_NQN), (1, NQN)}
        assert tcp[1, NQN].trtype == TransportType.TCP and tcp[1, NQN].tsas == bytes(256)
        rdma = {(e.portid, e.subnqn): e for e in discovery_page(target, 2)}
        assert set(rdma) == {(2, DISCOVERY_NQN), (2, NQN)}
        entry = rdma[2, NQN]
        assert entry.trtype == TransportType.RDMA and entry.traddr == "192.0.2.1"
        assert TSAS_RDMA.parse(entry.tsas) == TSAS_RDMA.parse(
            TSAS_RDMA.build(dict(qptype=1, prtype=1, cms=1, pkey=0)))  # RC QP, rdma_cm
        return target
    run(body)


def test_discovery_log_lists_the_ports_own_subsystems_for_this_host() -> None:
    """A subsystem exported on another port only, or closed to this host, is not listed; a
    port that went away leaves its discovery controller an empty log."""
    def body() -> Target:
        target, _ = make_target()
        target.add_port(PortInfo(2, "tcp", "127.0.0.1", "4421"))
        only2 = Subsystem("nqn.2026-11.io.blockd:only2", serial="ONLY2", model="m", port_ids={2})
        target.add_subsystem(only2)
        closed = Subsystem("nqn.2026-11.io.blockd:closed", serial="CLOSED", model="m",
                           allow_any_host=False, hosts={HOSTNQN})
        target.add_subsystem(closed)
        assert {e.subnqn for e in discovery_page(target, 1)} == {DISCOVERY_NQN, NQN, closed.nqn}
        assert {e.subnqn for e in discovery_page(target, 2)} == {DISCOVERY_NQN, NQN, only2.nqn, closed.nqn}
        assert {e.subnqn for e in discovery_page(target, 2, hostnqn="nqn.2014-08.org.nvmexpress:uuid:x")} == {
            DISCOVERY_NQN, NQN, only2.nqn}
        target.remove_port(2)
        assert discovery_page(target, 2) == []
        return target
    run(body)


def test_discovery_entries_advertise_sq_flow_control_disable() -> None:
    """TREQ as nvmet's for a port without TLS: secure channel not specified (bits 1:0 = 0), SQ
    flow control disable supported (bit 2); nvme-cli prints "not specified, sq flow control
    disable supported"."""
    def body() -> Target:
        target, _ = make_target()
        assert [e.treq for e in discovery_page(target, 1)] == [0x04, 0x04]
        return target
    run(body)


def error_log(admin: TargetQueue, entries: int = 4) -> list[Any]:
    """The Error Information log's first ``entries`` entries, newest first."""
    length = entries * ERROR_LOG_ENTRY_SIZE
    status, _, page = complete(admin, build_sqe(0x02, 60, dptr=transport_sgl(length),
                                                cdw10=0x01 | ((length // 4 - 1) << 16)))
    assert status == 0
    return [ERROR_LOG_ENTRY.parse(page[off:off + ERROR_LOG_ENTRY_SIZE])
            for off in range(0, length, ERROR_LOG_ENTRY_SIZE)]


def test_identify_ctratt_says_host_id_128_and_traffic_based_keep_alive() -> None:
    """CTRATT 0x41, as nvmet's I/O controllers: HIDS (bit 0) and TBKAS (bit 6), on the I/O and
    the discovery controller alike (any command resets either's keep-alive timer)."""
    def body() -> Target:
        target, _, admin, _ = admin_and_io()
        _, _, data = complete(admin, build_sqe(0x06, 9, dptr=transport_sgl(4096), cdw10=1))
        assert IDENTIFY_CONTROLLER.parse(data).ctratt == 0x41
        q, _ = new_queue(target)
        assert complete(q, connect_sqe(), connect_data(nqn=DISCOVERY_NQN))[0] == 0
        assert complete(q, prop_sqe(1, False, 0x14, value=0x00460001))[0] == 0
        _, _, data = complete(q, build_sqe(0x06, 2, dptr=transport_sgl(4096), cdw10=1))
        assert IDENTIFY_CONTROLLER.parse(data).ctratt == 0x41
        return target
    run(body)


def test_more_bit_goes_with_an_error_log_entry() -> None:
    """As nvmet_set_error: a failure with an error location gets an Error Information entry
    (the status without More, the location, SQID, CID, NSID) and the More bit in its CQE; a
    failure nvmet records no location for (Command Sequence Error, Keep Alive Invalid, SGL
    Invalid Offset) gets neither."""
    def body() -> Target:
        target, _, admin, io = admin_and_io()
        # Get Features with an unsupported FID: 0x6002 as nvme-cli shows it (DNR | More | 0x02).
        status, _, _ = complete(admin, build_sqe(0x0A, 3, dptr=transport_sgl(0), cdw10=0x7E))
        assert status == to_wire(Status.INVALID_FIELD | MORE) and status >> 1 == 0x6002
        status, _, _ = complete(io, rw_sqe(0x02, 4, 0, 1, transport_sgl(512), nsid=9))
        assert status == to_wire(Status.INVALID_NS | MORE)
        newest, older = error_log(admin, 2)
        assert (newest.error_count, newest.sqid, newest.cid, newest.nsid) == (2, 1, 4, 9)
        assert (newest.status, newest.param_location) == (to_wire(Status.INVALID_NS), 4)  # NSID
        assert (older.error_count, older.sqid, older.cid) == (1, 0, 3)
        assert (older.status, older.param_location) == (to_wire(Status.INVALID_FIELD), 40)  # CDW10
        # No entry, no More: Keep Alive without KATO, an SGL offset, a command before enable.
        admin.controller.kato_ms = 0
        ka = complete(admin, build_sqe(0x18, 6, dptr=transport_sgl(0)))[0]
        assert ka == to_wire(Status.KEEP_ALIVE_INVALID)
        offset = complete(io, rw_sqe(0x01, 7, 0, 1, incapsule_sgl(512, offset=4)), b"\0" * 512)[0]
        assert offset == to_wire(Status.SGL_INVALID_OFFSET)
        fresh, _ = new_queue(target)
        assert complete(fresh, connect_sqe(), connect_data())[0] == 0
        seq = complete(fresh, build_sqe(0x06, 8, dptr=transport_sgl(4096), cdw10=1))[0]
        assert seq == to_wire(Status.COMMAND_SEQUENCE_ERROR)
        assert fresh.controller.error_count == 0
        assert error_log(admin, 1)[0].error_count == 2
        return target
    run(body)


def test_unsupported_log_page_is_invalid_field() -> None:
    """Get Log Page of a LID the controller does not have: Invalid Field in Command at CDW10 (the
    LID), as nvmet_execute_get_log_page and nvmet_execute_disc_get_log_page answer and as NVMe
    Base 2.0's Get Log Page says, not the command-specific Invalid Log Page; on the I/O and on
    the discovery controller."""
    def body() -> Target:
        target, _, admin, _ = admin_and_io()
        status = complete(admin, build_sqe(0x02, 3, dptr=transport_sgl(512), cdw10=0x7F | (127 << 16)))[0]
        assert status == to_wire(Status.INVALID_FIELD | MORE) and status >> 1 == 0x6002
        entry = error_log(admin, 1)[0]
        assert (entry.status, entry.param_location, entry.cid) == (to_wire(Status.INVALID_FIELD), 40, 3)
        q, _ = new_queue(target)
        assert complete(q, connect_sqe(), connect_data(nqn=DISCOVERY_NQN))[0] == 0
        assert complete(q, prop_sqe(1, False, 0x14, value=0x00460001))[0] == 0
        status = complete(q, build_sqe(0x02, 4, dptr=transport_sgl(512), cdw10=0x02 | (127 << 16)))[0]
        assert status == to_wire(Status.INVALID_FIELD | MORE)
        return target
    run(body)


def test_traffic_based_keep_alive_gives_a_second_period() -> None:
    """With TBKAS any command restarts the keep-alive timer: a period in which commands arrived
    starts another (as nvmet's reset_tbkas), so a host is torn down only after a whole period
    without any, between one and two KATO after its last command; a Keep Alive restarts it."""
    def body() -> Target:
        target, _, admin, io = admin_and_io()  # KATO 5 s
        ctrl = admin.controller
        start = ctrl.keep_alive_deadline - 5
        assert not ctrl.keep_alive_expired(start + 4.9)
        assert complete(io, rw_sqe(0x02, 1, 0, 1, transport_sgl(512)))[0] == 0
        assert not ctrl.keep_alive_expired(start + 5.1)  # traffic in the period: another one
        assert ctrl.keep_alive_deadline == pytest.approx(start + 10.1)
        assert ctrl.keep_alive_expired(start + 10.2)  # a silent period: gone
        assert complete(admin, build_sqe(0x18, 2, dptr=transport_sgl(0)))[0] == 0  # Keep Alive
        assert not ctrl.keep_alive_expired(ctrl.keep_alive_deadline - 0.1)
        return target
    run(body)
