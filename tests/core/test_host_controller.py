"""The host controller's middle without sockets: a fake transport (registered in
``initiator.transport.TRANSPORTS``) answers the association set-up itself and leaves every
I/O command to the test, which completes, fails or loses it by hand.

Covered here: status -> NvmeError, waiting for room, reconnect with I/O in flight (each
command completes exactly once), the retry limit, giving up after ctrl_loss_tmo, the timeout
sweep, and ``transfer`` splitting at ``max_transfer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import initiator.controller as controller_module
from initiator.association import MAX_ATTEMPTS
from initiator.controller import Controller
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator.params import ConnectParams
from initiator.transport import TRANSPORTS
from initiator.queue import HostCommand, HostQueue
from protocol.constants import AdminOpcode, Cns, FabricsType, FeatureId, IoOpcode, Property
from protocol.fabrics import FABRICS_COMMAND, PROPERTY_COMMAND
from protocol.identify import ACTIVE_NS_LIST, IDENTIFY_CONTROLLER, IDENTIFY_NAMESPACE, IDENTIFY_SIZE
from protocol.layout import fixed_layout
from protocol.commands import SET_FEATURES_COMMAND, read_command
from protocol.nvme import IDENTIFY_COMMAND, RW_FAST, SQE_FAST
from protocol.status import DNR, Status

from .conftest import run

NSID = 1
BLOCK = 512
NS_BLOCKS = 1 << 16
_fabrics = fixed_layout(FABRICS_COMMAND)
_property = fixed_layout(PROPERTY_COMMAND)
_identify = fixed_layout(IDENTIFY_COMMAND)
_set_features = fixed_layout(SET_FEATURES_COMMAND)
_TARGETS: dict[str, FakeTarget] = {}


class FakeConnection:
    """A ``QueueConnection`` with no socket: ``submit`` records, the test answers."""

    def __init__(self, target: FakeTarget, queue: HostQueue,
                 on_lost: Callable[[Any, Exception | None], None]) -> None:
        self.target = target
        self.queue = queue
        self.on_lost = on_lost
        self.inline_limit = 8192
        self.closed = False
        self.connect_cattr = 0
        self.holds = 0
        self.sent: list[HostCommand] = []

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1

    def submit(self, cmd: HostCommand) -> None:
        if self.closed:
            raise QueueLost("closed")
        self.queue.start(cmd)
        if self.queue.qid == 0 or SQE_FAST.as_dict(cmd.sqe)["opcode"] == AdminOpcode.FABRICS:
            asyncio.get_running_loop().call_soon(self.target.answer_admin, self, cmd)
        else:
            self.sent.append(cmd)
            self.target.io_sent.append(cmd)

    def close(self) -> None:
        """As a transport: the loss is reported from the loop, not from inside ``close``."""
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.on_lost, self, None)

    def complete(self, cmd: HostCommand, status: int = 0, dw0: int = 0) -> None:
        """The target's completion of ``cmd`` arrives."""
        assert self.queue.finish(cmd.cid) is cmd
        cmd.status = status
        cmd.dw0 = dw0
        cmd.complete()


class FakeTarget:
    """Answers Connect, Property Get/Set, Identify and Set Features like a controller with one
    namespace of 512-byte blocks; ``mdts`` sets the host's max transfer (4 KiB << mdts)."""

    def __init__(self, name: str, mdts: int = 0, maxcmd: int = 0) -> None:
        self.name = name
        self.mdts = mdts
        self.maxcmd = maxcmd
        self.conns: list[FakeConnection] = []
        self.io_sent: list[HostCommand] = []
        self.refuse = False
        self.connects = 0
        _TARGETS[name] = self

    async def open_queue(self, params: ConnectParams, queue: HostQueue,
                         on_lost: Callable[[Any, Exception | None], None]) -> FakeConnection:
        if self.refuse:
            raise ConnectError("refused")
        conn = FakeConnection(self, queue, on_lost)
        self.conns.append(conn)
        return conn

    @property
    def io(self) -> FakeConnection:
        """The newest I/O queue."""
        return [c for c in self.conns if c.queue.qid][-1]

    def answer_admin(self, conn: FakeConnection, cmd: HostCommand) -> None:
        if conn.closed or conn.queue.get(cmd.cid) is not cmd:
            return
        opcode = SQE_FAST.as_dict(cmd.sqe)["opcode"]
        dw0 = 0
        if opcode == AdminOpcode.FABRICS:
            fctype = _fabrics.as_dict(cmd.sqe)["fctype"]
            if fctype == FabricsType.CONNECT:
                self.connects += 1
                dw0 = 1
            elif fctype == FabricsType.PROPERTY_GET:
                offset = _property.as_dict(cmd.sqe)["offset"]
                dw0 = {Property.CAP: 0, Property.CSTS: 1 | 2 << 2}[offset]
        elif opcode == AdminOpcode.IDENTIFY:
            cmd.data_in[:] = self._identify(_identify.as_dict(cmd.sqe)["cns"])
        elif opcode == AdminOpcode.SET_FEATURES:
            fields = _set_features.as_dict(cmd.sqe)
            assert fields["fid"] == FeatureId.NUMBER_OF_QUEUES
            dw0 = fields["cdw11"]
        conn.complete(cmd, 0, dw0)

    def _identify(self, cns: int) -> bytes:
        if cns == Cns.CONTROLLER:
            ident = IDENTIFY_CONTROLLER.parse(bytes(IDENTIFY_SIZE))
            ident.update(dict(cntlid=1, mdts=self.mdts, maxcmd=self.maxcmd, ioccsz=(64 + 8192) // 16))
            return IDENTIFY_CONTROLLER.build(ident)
        if cns == Cns.ACTIVE_NS_LIST:
            return ACTIVE_NS_LIST.build([NSID] + [0] * (IDENTIFY_SIZE // 4 - 1))
        ident = IDENTIFY_NAMESPACE.parse(bytes(IDENTIFY_SIZE))
        ident.update(dict(nsze=NS_BLOCKS, ncap=NS_BLOCKS, nuse=NS_BLOCKS))
        ident.lbaf[0].lbads = 9
        return IDENTIFY_NAMESPACE.build(ident)


async def open_queue(params: ConnectParams, queue: HostQueue,
                     on_lost: Callable[[Any, Exception | None], None]) -> FakeConnection:
    """The fake transport's ``QueueOpener``: ``traddr`` names the :class:`FakeTarget`."""
    return await _TARGETS[params.traddr].open_queue(params, queue, on_lost)


@pytest.fixture(autouse=True)
def fake_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSPORTS, "fake", __name__)
    _TARGETS.clear()


async def connect(target: FakeTarget, **kw: Any) -> Controller:
    params = ConnectParams(traddr=target.name, subnqn="nqn.test", transport="fake", nr_io_queues=1,
                           keep_alive_tmo=0, reconnect_delay=0.01, **kw)
    return await Controller.connect(params)


class Done:
    """An ``IoDone`` that records every call."""

    def __init__(self) -> None:
        self.calls: list[BaseException | None] = []

    def __call__(self, exc: BaseException | None) -> None:
        self.calls.append(exc)

    @property
    def once_ok(self) -> bool:
        return self.calls == [None]


def read_sqe(slba: int = 0, nlb0: int = 0) -> bytearray:
    return read_command(NSID, slba, nlb0)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


def rw(cmd: HostCommand) -> dict[str, Any]:
    return RW_FAST.as_dict(cmd.sqe)


# -- completion --------------------------------------------------------------------------------


def test_status_becomes_nvme_error_once() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        ok, bad = Done(), Done()
        ctrl.submit_io(read_sqe(0), None, memoryview(bytearray(BLOCK)), ok)
        ctrl.submit_io(read_sqe(NS_BLOCKS), None, memoryview(bytearray(BLOCK)), bad)
        first, second = target.io.sent
        target.io.complete(first)
        target.io.complete(second, Status.LBA_RANGE)
        assert ok.once_ok
        [exc] = bad.calls
        assert isinstance(exc, NvmeError) and exc.status == Status.LBA_RANGE
        assert "read on namespace 1" in str(exc)
        with pytest.raises(NvmeError) as err:  # the awaitable wrapper raises the same
            task = asyncio.ensure_future(ctrl.read(NSID, NS_BLOCKS, 1))
            await until(lambda: len(target.io.sent) == 3)
            target.io.complete(target.io.sent[2], Status.LBA_RANGE)
            await task
        assert err.value.status == Status.LBA_RANGE
        await ctrl.close()

    run(main())


def test_an_io_commands_sct1_0x83_is_oncs_not_supported_not_restart_discovery() -> None:
    """nvmet answers a Write Zeroes its backend cannot do with SCT 1 SC 0x83; on an I/O command
    that is ONCS Not Supported (the name Connect Restart Discovery belongs to Connect's answer)."""
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        task = asyncio.ensure_future(ctrl.write_zeroes(NSID, 0, 8))
        await until(lambda: len(target.io.sent) == 1)
        target.io.complete(target.io.sent[0], 0x183 | DNR)
        with pytest.raises(NvmeError, match="ONCS_NOT_SUPPORTED"):
            await task
        await ctrl.close()

    run(main())


def test_submit_goes_out_at_once_inside_a_hold() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        seen: list[int] = []
        orig = target.io.submit

        def submit(cmd: HostCommand) -> None:
            seen.append(target.io.holds)
            orig(cmd)
        target.io.submit = submit  # type: ignore[method-assign]
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), Done())
        ctrl.hold_sends()
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), Done())
        assert target.io.holds == 1
        ctrl.release_sends()
        assert seen == [1, 2] and target.io.holds == 0
        await ctrl.close()

    run(main())


# -- room --------------------------------------------------------------------------------------


def test_full_queue_parks_until_a_completion_frees_an_id() -> None:
    async def main() -> None:
        target = FakeTarget("t", maxcmd=2)
        ctrl = await connect(target)
        dones = [Done() for _ in range(5)]
        for i, done in enumerate(dones):
            ctrl.submit_io(read_sqe(i), None, memoryview(bytearray(BLOCK)), done)
        io = target.io
        assert [rw(c)["slba"] for c in io.sent] == [0, 1]  # depth 2: the rest waits, in order
        io.complete(io.sent[0])
        assert [rw(c)["slba"] for c in io.sent] == [0, 1, 2]
        for cmd in io.sent[1:3]:
            io.complete(cmd)
        assert [rw(c)["slba"] for c in io.sent] == [0, 1, 2, 3, 4]
        for cmd in io.sent[3:]:
            io.complete(cmd)
        assert all(d.once_ok for d in dones)
        await ctrl.close()

    run(main())


# -- reconnect ---------------------------------------------------------------------------------


def test_reconnect_resends_io_in_flight_each_completes_once() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        first_io = target.io
        dones = [Done() for _ in range(3)]
        for i, done in enumerate(dones):
            ctrl.submit_io(read_sqe(i), None, memoryview(bytearray(BLOCK)), done)
        first_io.complete(first_io.sent[0])  # one finished before the loss
        first_io.close()
        await until(lambda: ctrl.state == "reconnecting")
        late = Done()  # submitted while reconnecting: waits, then goes
        ctrl.submit_io(read_sqe(9), None, memoryview(bytearray(BLOCK)), late)
        await until(lambda: ctrl.state == "live" and target.io is not first_io and len(target.io.sent) == 3)
        again = target.io
        assert sorted(rw(c)["slba"] for c in again.sent) == [1, 2, 9]
        for cmd in list(again.sent):
            again.complete(cmd)
        assert all(d.once_ok for d in dones) and late.once_ok
        assert target.connects == 4  # admin + I/O queue, twice
        await ctrl.close()

    run(main())


def test_retry_limit_fails_a_command_lost_too_often() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        done = Done()
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), done)
        for attempt in range(MAX_ATTEMPTS + 1):
            io = target.io
            await until(lambda: len(io.sent) == 1)
            assert not done.calls
            io.close()
            await until(lambda: ctrl.state == "live" and target.io is not io)
        await until(lambda: bool(done.calls))
        [exc] = done.calls
        assert isinstance(exc, QueueLost) and "repeated reconnects" in str(exc)
        await ctrl.close()

    run(main())


def test_reconnect_gives_up_after_ctrl_loss_tmo() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target, ctrl_loss_tmo=0.2)
        inflight, parked = Done(), Done()
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), inflight)
        target.refuse = True
        target.io.close()
        await until(lambda: ctrl.state == "reconnecting")
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), parked)
        await until(lambda: ctrl.state == "failed")
        for done in (inflight, parked):
            [exc] = done.calls
            assert isinstance(exc, QueueLost)
        after = Done()
        ctrl.submit_io(read_sqe(), None, memoryview(bytearray(BLOCK)), after)
        assert len(after.calls) == 1 and isinstance(after.calls[0], QueueLost)
        await ctrl.close()

    run(main())


# -- timeouts ----------------------------------------------------------------------------------


def test_timeout_sweep_fails_the_late_command_and_retries_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep every 50 ms: the late command (deadline 1.0 s) is failed by 1.05 s, well before the
    # other's deadline (1.4 s), however the sweep's phase falls. With the default 0.5 s sweep and
    # deadlines 0.2 s apart, a sweep late in its period caught both (seen failing under load).
    monkeypatch.setattr(controller_module, "TIMEOUT_SWEEP", 0.05)

    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target, command_timeout=1.0)
        io = target.io
        late, other = Done(), Done()
        ctrl.submit_io(read_sqe(1), None, memoryview(bytearray(BLOCK)), late)
        await asyncio.sleep(0.4)
        ctrl.submit_io(read_sqe(2), None, memoryview(bytearray(BLOCK)), other)
        await until(lambda: bool(late.calls), timeout=3)
        [exc] = late.calls
        assert isinstance(exc, TimeoutError) and "read on namespace 1" in str(exc)
        assert io.closed  # its ids cannot be reused safely: the association is reset
        await until(lambda: ctrl.state == "live" and target.io is not io and len(target.io.sent) == 1)
        assert rw(target.io.sent[0])["slba"] == 2 and not other.calls
        target.io.complete(target.io.sent[0])
        assert other.once_ok and late.calls == [exc]
        await ctrl.close()

    run(main())


# -- transfer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [BLOCK, 8192 - BLOCK, 8192, 8192 + BLOCK, 3 * 8192, 3 * 8192 + 2 * BLOCK])
def test_transfer_splits_at_max_transfer(length: int) -> None:
    async def main() -> None:
        target = FakeTarget("t", mdts=1)  # 8 KiB
        ctrl = await connect(target)
        assert ctrl.max_transfer == 8192
        offset = 3 * BLOCK
        done = Done()
        data = memoryview(bytearray(length))
        ctrl.transfer(True, NSID, offset, data, done, fua=True)
        io = target.io
        pieces = [(rw(c)["slba"], rw(c)["nlb"] + 1, len(c.data_out)) for c in io.sent]
        expect, pos = [], 0
        while pos < length:
            n = min(8192, length - pos)
            expect.append(((offset + pos) // BLOCK, n // BLOCK, n))
            pos += n
        assert pieces == expect
        assert all(rw(c)["opcode"] == IoOpcode.WRITE and rw(c)["control"] for c in io.sent)  # FUA on each
        for cmd in io.sent[:-1]:
            io.complete(cmd)
            assert not done.calls
        io.complete(io.sent[-1])
        assert done.once_ok
        await ctrl.close()

    run(main())


def test_transfer_reports_the_first_error_once() -> None:
    async def main() -> None:
        target = FakeTarget("t", mdts=1)
        ctrl = await connect(target)
        done = Done()
        ctrl.transfer(False, NSID, 0, memoryview(bytearray(3 * 8192)), done)
        a, b, c = target.io.sent
        target.io.complete(b, Status.UNRECOVERED_READ_ERROR)
        target.io.complete(a)
        target.io.complete(c, Status.DATA_TRANSFER_ERROR)
        [exc] = done.calls
        assert isinstance(exc, NvmeError) and exc.status == Status.UNRECOVERED_READ_ERROR
        await ctrl.close()

    run(main())


def test_transfer_refuses_bad_ranges_before_sending() -> None:
    async def main() -> None:
        target = FakeTarget("t")
        ctrl = await connect(target)
        for offset, length in ((1, BLOCK), (0, BLOCK + 1), ((NS_BLOCKS - 1) * BLOCK, 2 * BLOCK), (-BLOCK, BLOCK)):
            with pytest.raises(ValueError):
                ctrl.transfer(False, NSID, offset, memoryview(bytearray(length)), Done())
        assert not target.io.sent
        await ctrl.close()

    run(main())
