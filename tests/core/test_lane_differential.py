"""The compiled I/O lane (``initiator/_lane.pyx``) against the controller's Python path: two
controllers, one whose ``transfer`` is the lane's and one whose is ``Controller.transfer``, get
the same random calls (aligned and not, inside and outside the namespace, negative and huge
offsets, unknown and odd namespace ids, one command and several, FUA, zero length) in the same
random states (live, reconnecting, failed, queues full, a queue closed, commands parked) and the
same random completions (success, error statuses, short reads); every capsule each queue sends,
every ``done`` and its error, every exception a call raises, the commands left parked and in
flight, and the I/O counters must be the same.

The lane mirrors the controller's state in C fields (``IoLane.sync``), so the random states are
reached through the controller's own setters and change what a stale mirror would get wrong:
reconnects onto new queues (one or two, another ``max_transfer``), failure and recovery, and
namespace tables that drop, shrink, add and re-block namespaces."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from blockd.tcp_pdu import PduWriter
from initiator import controller as controller_mod
from initiator.controller import ConnectParams, Controller, HostQueue, NamespaceInfo
from initiator.errors import NvmeError
from initiator.tcp import TcpHostConnection
from protocol.commands import read_command, write_command
from protocol.nvme import CQE_FAST
from protocol.status import Status, to_wire
from protocol.tcp import PduFlags, PduType

_lane = pytest.importorskip("initiator._lane", reason="compiled data plane not built")
if controller_mod.IoLane is None:
    pytest.skip("the controller runs the Python plane (BLOCKD_PURE)", allow_module_level=True)

NAMESPACES = {1: NamespaceInfo(1, 256, 512, False), 2: NamespaceInfo(2, 64, 4096, False)}
TABLES = [NAMESPACES, {1: NAMESPACES[1]}, {1: NamespaceInfo(1, 16, 512, False), 2: NAMESPACES[2]},
          {**NAMESPACES, 3: NamespaceInfo(3, 32, 512, False)}, {1: NamespaceInfo(1, 64, 4096, False)}, {}]
"""Namespace tables a rescan may find (``_call`` picks offsets by the first)."""
MAX_TRANSFER = 16384


class _Transport:
    """Records what the queue writes."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: Any) -> None:
        self.sent.append(bytes(data))

    def writelines(self, bufs: Any) -> None:
        self.sent.append(b"".join(bytes(b) for b in bufs))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str) -> None:
        return None

    def close(self) -> None:
        pass


class _Clock:
    """The controllers' event-loop time (their deadlines): the same on both, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now


def _queues(n: int) -> list[TcpHostConnection]:
    conns = []
    for qid in range(1, n + 1):
        conn = TcpHostConnection(HostQueue(qid, 3), lambda *_: None)
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        conn.maxh2cdata = 8192
        conn.inline_limit = 4096
        conns.append(conn)
    return conns


def _controller(lane: bool, clock: _Clock) -> Controller:
    ctrl = Controller(ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:lane"), lane=lane)
    ctrl._loop = clock  # type: ignore[assignment]
    ctrl.max_transfer = MAX_TRANSFER
    ctrl.namespaces = dict(NAMESPACES)
    ctrl.io = _queues(2)
    ctrl._set_live(True)
    return ctrl


def _reconnect(ctrl: Controller, queues: int, max_transfer: int, sent: list[list[bytes]]) -> None:
    """What a lost queue and ``_establish`` do to the state the lane mirrors: the association
    goes down, what was in flight is parked, new queues and limits come in, it is live again
    and the parked commands go out on the new queues."""
    ctrl._set_live(False)
    for conn in ctrl.io:
        sent.append(conn.transport.sent)
        for cmd in conn.queue.take_all():
            cmd.attempts += 1
            ctrl._park(cmd)
    ctrl.io = _queues(queues)
    ctrl.max_transfer = max_transfer
    ctrl._set_live(True)
    ctrl._unpark()


def _feed(conn: TcpHostConnection, raw: bytes) -> None:
    """``raw`` received, in the pieces the reader's buffer takes."""
    while raw:
        buf = conn.get_buffer(len(raw))
        n = min(len(buf), len(raw))
        if not n:  # a connection that ended takes nothing more
            return
        buf[:n] = raw[:n]
        conn.buffer_updated(n)
        raw = raw[n:]


def _describe(exc: BaseException | None) -> Any:
    if exc is None:
        return None
    return (type(exc).__name__, getattr(exc, "status", None), str(exc))


def _call(rng: random.Random) -> tuple[Any, ...]:
    """Random ``transfer`` arguments: (write, nsid, offset, length, fua)."""
    nsid = rng.choice([1, 1, 1, 2, 2, 3, True, 2**40])
    bs = NAMESPACES[2].block_size if nsid == 2 else 512
    size = NAMESPACES[2].size if nsid == 2 else NAMESPACES[1].size
    length = rng.choice([bs, bs, 2 * bs, 4 * bs, 0, MAX_TRANSFER, MAX_TRANSFER + bs, 3 * MAX_TRANSFER, 100, bs + 1])
    offset = rng.choice([0, bs * rng.randrange(size // bs), size - bs, size - length, size, 7, -bs, 2**64, 2**70])
    return (rng.random() < 0.45, nsid, offset, length, rng.random() < 0.2)


def _run(seed: int) -> None:
    rng = random.Random(seed)
    clock = _Clock()
    started = time.monotonic_ns()
    ctrls = [_controller(True, clock), _controller(False, clock)]
    assert ctrls[0].transfer != ctrls[0].__class__.transfer.__get__(ctrls[0])  # the lane is in use
    logs: list[list[Any]] = [[], []]
    sent: list[list[list[bytes]]] = [[], []]  # what the queues replaced by reconnects sent
    writer = PduWriter()
    for step in range(120):
        clock.now += rng.choice([0.0, 0.001, 0.5])
        r = rng.random()
        if r < 0.5:
            write, nsid, offset, length, fua = _call(rng)
            data = rng.randbytes(max(length, 0)) if length <= 4 * MAX_TRANSFER else b""
            for i, ctrl in enumerate(ctrls):
                buf = memoryview(bytearray(data))
                log = logs[i]
                try:
                    ctrl.transfer(write, nsid, offset, buf, lambda exc, n=step, log=log: log.append((n, _describe(exc))), fua)
                except Exception as exc:  # the same refusal from both
                    log.append((step, "raised", _describe(exc)))
        elif r < 0.8:
            # the target answers one command in flight (the same id on both)
            pending = [sorted(conn.queue.pending) for conn in ctrls[0].io]
            assert pending == [sorted(conn.queue.pending) for conn in ctrls[1].io]
            choices = [(k, cid) for k, cids in enumerate(pending) for cid in cids]
            if not choices:
                continue
            k, cid = rng.choice(choices)
            cmd = ctrls[0].io[k].queue.get(cid)
            status = rng.choice([0, 0, 0, 0, int(Status.LBA_RANGE), int(Status.INVALID_FIELD)])
            answer: list[bytes] = []
            if cmd.data_in is not None and not status:
                n = len(cmd.data_in)
                if n > 512 and rng.random() < 0.1:
                    n -= 512  # a short read now and then
                payload = rng.randbytes(n)
                last = PduFlags.LAST_PDU | PduFlags.SUCCESS if n == len(cmd.data_in) else PduFlags.LAST_PDU
                answer.append(b"".join(bytes(b) for b in writer.data_pdu(PduType.C2H_DATA, cid, 0, 0, payload, last)))
                if not last & PduFlags.SUCCESS:
                    answer.append(b"".join(writer.pdu(PduType.CAPSULE_RESP, CQE_FAST.pack(0, 0, 0, 0, cid, 0))))
            else:
                wire = to_wire(status) if status else 0
                answer.append(b"".join(writer.pdu(PduType.CAPSULE_RESP, CQE_FAST.pack(7, 0, 0, 0, cid, wire))))
            raw = b"".join(answer)
            for ctrl in ctrls:
                _feed(ctrl.io[k], raw)
        elif r < 0.86:
            for ctrl in ctrls:  # the association goes down for a while (commands park)
                ctrl._set_live(False)
        elif r < 0.93:
            for ctrl in ctrls:  # and comes back
                ctrl._set_live(True)
                ctrl._unpark()
        elif r < 0.95:
            k = rng.randrange(len(ctrls[0].io))
            closed = rng.random() < 0.5
            for ctrl in ctrls:  # a queue seen closed before its loss is reported
                ctrl.io[k].closed = closed
        elif r < 0.97:
            queues, max_transfer = rng.choice([1, 2]), rng.choice([MAX_TRANSFER, MAX_TRANSFER // 4, 4 * MAX_TRANSFER])
            for i, ctrl in enumerate(ctrls):
                _reconnect(ctrl, queues, max_transfer, sent[i])
        elif r < 0.985:
            for ctrl in ctrls:  # given up, and (a new controller, as far as the lane can tell) back
                ctrl._set_failed(NvmeError(int(Status.INTERNAL_ERROR), "gone") if ctrl.failed is None else None)
        else:
            table = rng.choice(TABLES)
            for ctrl in ctrls:  # a rescan replaces the table
                ctrl._set_namespaces(dict(table))
    assert logs[0] == logs[1]
    assert sent[0] == sent[1]
    for a, b in zip(ctrls[0].io, ctrls[1].io):
        assert a.transport.sent == b.transport.sent
        assert sorted(a.queue.pending) == sorted(b.queue.pending)
    for name in ("ops", "bytes", "errors"):
        assert getattr(ctrls[0].counters, name) == getattr(ctrls[1].counters, name), name
    # latencies are monotonic_ns from each command's send (not the test's clock): as many
    # counted on both, none longer than the run
    elapsed = time.monotonic_ns() - started
    for ctrl in ctrls:
        assert sum(ctrl.counters.buckets) == sum(ctrl.counters.ops)
        assert ctrl.counters.latency_ns <= elapsed * sum(ctrl.counters.ops)
    assert [bytes(c.sqe) for c in ctrls[0]._parked_io] == [bytes(c.sqe) for c in ctrls[1]._parked_io]


@pytest.mark.parametrize("seed", range(300))
def test_lane_matches_the_python_path(seed: int) -> None:
    async def main() -> None:
        _run(seed)
    asyncio.run(main())


def test_the_lane_builds_protocol_s_read_and_write_commands() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        nsid, slba, nlb0, fua = rng.getrandbits(32), rng.getrandbits(64), rng.getrandbits(16), rng.random() < 0.5
        assert _lane.rw_sqe(False, nsid, slba, nlb0) == read_command(nsid, slba, nlb0)
        assert _lane.rw_sqe(True, nsid, slba, nlb0, fua) == write_command(nsid, slba, nlb0, fua)


def test_a_controller_uses_the_lane_by_default_when_compiled() -> None:
    async def main() -> None:
        ctrl = Controller(ConnectParams(traddr="127.0.0.1", subnqn="nqn.2026-11.io.blockd:lane"))
        assert (controller_mod.IoLane is not None) == ("transfer" in vars(ctrl))
    asyncio.run(main())
