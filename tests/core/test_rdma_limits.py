"""The NVMe/RDMA target's daemon-wide limits without a device (issue 12): what a CM connect
request is checked against before anything is created for it -- the connection maxima, shared
with NVMe/TCP, and the receive-buffer budget ``rdma_recv_total`` -- what is given back when a
queue goes, the hello timeout of a queue that never sends Connect, and read replies waiting for
a registered slot counted against ``max_unsent_total``. The VM group's
``test_hostile_host_limits`` runs the same against a real rxe host."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace
from typing import Any

import pytest

from protocol import rdma_cm as pcm
from protocol.nvme import SQE_SIZE
from target import rdma
from target.config import Limits
from target.rdma import RDMA_INLINE, RdmaListener, RdmaTargetConnection
from target.target import PortInfo, Target

MiB = 1 << 20
ADMIN_RECV = 32 * SQE_SIZE
IO_RECV = 128 * (SQE_SIZE + RDMA_INLINE)


class _Request:
    """A CM connect request as :meth:`RdmaListener._on_request` reads it."""

    def __init__(self, qid: int, depth: int) -> None:
        self.nvme = SimpleNamespace(qid=qid, hsqsize=depth - 1, hrqsize=depth)
        self.peer = ""  # no peer address: every request counts for the host ""
        self.done = False
        self.rejected: int | None = None

    def reject_nvme(self, sts: int) -> None:
        self.rejected = sts
        self.done = True


class _Accepted:
    """Stands for the queue the listener would set up; ``fail`` makes setting it up fail."""

    fail = False

    def __init__(self, listener: RdmaListener, creq: _Request, host: str, recv_bytes: int) -> None:
        if self.fail:
            raise OSError("no memory for the QP")
        self.admitted = (host, recv_bytes)


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> RdmaListener:
    monkeypatch.setattr(rdma, "RdmaTargetConnection", _Accepted)
    target = Target(limits=Limits(max_connections=4, max_connections_per_host=3,
                                  rdma_recv_total=2 * ADMIN_RECV + IO_RECV + ADMIN_RECV // 2))
    return RdmaListener(target, PortInfo(1, "rdma", "192.0.2.1", "4420"))


def _request(listener: RdmaListener, qid: int, depth: int) -> tuple[_Request, Any]:
    creq = _Request(qid, depth)
    before = set(listener.connections)
    listener._on_request(creq)
    new = set(listener.connections) - before
    return creq, new.pop() if new else None


def test_receive_buffers_over_the_budget_are_refused_with_no_resources(listener: RdmaListener) -> None:
    target = listener.target
    _, io = _request(listener, 1, 128)
    _, admin = _request(listener, 0, 32)
    assert io.admitted == ("", IO_RECV) and admin.admitted == ("", ADMIN_RECV)
    assert target.rdma_recv.used == IO_RECV + ADMIN_RECV
    creq, conn = _request(listener, 1, 2)  # 2 x 4160 bytes more: over the budget
    assert conn is None and creq.rejected == pcm.STS_NO_RESOURCES
    assert target.rdma_recv.used == IO_RECV + ADMIN_RECV and target.connections.total == 2
    _, small = _request(listener, 0, 32)  # 2 KiB more still fits
    assert small is not None and target.connections.total == 3
    listener.release(*io.admitted)  # the queue went: its buffers and its count are free again
    assert target.rdma_recv.used == 2 * ADMIN_RECV and target.connections.total == 2
    _, io = _request(listener, 1, 128)
    assert io is not None


def test_connections_over_the_maxima_are_refused_with_no_resources(listener: RdmaListener) -> None:
    target = listener.target
    queues = [_request(listener, 0, 2)[1] for _ in range(3)]
    assert all(queues) and target.connections.by_host == {"": 3}
    creq, conn = _request(listener, 0, 2)  # a fourth from the same host
    assert conn is None and creq.rejected == pcm.STS_NO_RESOURCES
    assert target.connections.total == 3 and target.rdma_recv.used == 3 * 2 * SQE_SIZE
    listener.release(*queues[0].admitted)
    assert _request(listener, 0, 2)[1] is not None


def test_a_queue_that_cannot_be_set_up_gives_back_what_it_was_counted(listener: RdmaListener,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Accepted, "fail", True)
    creq, conn = _request(listener, 1, 128)
    assert conn is None and creq.rejected == pcm.STS_NO_RESOURCES
    assert listener.target.connections.total == 0 and listener.target.rdma_recv.used == 0


class _Queue:
    def __init__(self, controller: object | None) -> None:
        self.controller = controller
        self.teardown: tuple[str, dict[str, str]] | None = None

    def note_teardown(self, cause: str, **detail: str) -> None:
        self.teardown = self.teardown or (cause, detail)


@pytest.mark.parametrize("connected", [False, True])
def test_hello_timeout_closes_a_queue_that_sent_no_connect(connected: bool) -> None:
    c = object.__new__(RdmaTargetConnection)
    c.listener = SimpleNamespace(target=Target(limits=Limits(hello_timeout=3.0)))
    c.queue = _Queue(object() if connected else None)
    c.closing = False
    c.close = lambda: setattr(c, "closing", True)
    c._hello_expired()
    if connected:
        assert not c.closing and c.queue.teardown is None
    else:
        assert c.closing and c.queue.teardown == ("no Connect in time", {"timeout": "3.0"})


class _Pool:
    """The device's data slots with none free: ``get`` waits until the test gives one."""

    def __init__(self) -> None:
        self.waiting: list = []

    def get(self, length: int, callback) -> None:
        self.waiting.append(callback)

    def put(self, slot: object) -> None:
        pass


class _Core:
    def __init__(self) -> None:
        self.submitted: list[bytes] = []

    def submit(self, sqe: memoryview, data: memoryview | None, cmd: object) -> None:
        self.submitted.append(bytes(sqe[:1]))


def test_replies_waiting_for_a_data_slot_count_against_max_unsent_total() -> None:
    """A read whose data waits in memory for a registered slot counts against the daemon-wide
    ``max_unsent_total`` (shared with NVMe/TCP); past it the queue leaves new commands in their
    receive slots, unsubmitted, and submits them in order once the total has dropped."""
    from target.limits import UnsentTotal

    async def main() -> None:
        c = object.__new__(RdmaTargetConnection)
        c.loop = asyncio.get_running_loop()
        c.closing, c.batching, c.send_out, c.recv_out = False, False, [], []
        c.unsent_total = UnsentTotal(MiB // 2)
        c.unsent_total.POLL = 0.01
        c.waiting_bytes, c.deferring, c.deferred = 0, False, collections.deque()
        c.data, c.queue, c.cmds = _Pool(), _Core(), set()
        c.recv_pool = SimpleNamespace(slots=[SimpleNamespace(view=memoryview(bytes([i]) * 128)) for i in range(4)])
        responded: list[object] = []
        c._respond = responded.append
        cmd = rdma.RdmaCommand(0)
        reply = bytes(range(256)) * 4096
        req = SimpleNamespace(reply=reply, length=MiB, transport_ctx=cmd)
        c.queue_response(req)
        assert c.waiting_bytes == MiB and c.unsent_total.total == MiB and c.deferring
        c._command(2, 64)
        c._command(1, 64)
        assert c.queue.submitted == [] and list(c.deferred) == [(2, 64), (1, 64)]
        slot = SimpleNamespace(view=memoryview(bytearray(MiB)), size=MiB)
        c.data.waiting.pop()(slot)  # a slot came back: the reply is copied, the memory freed
        assert c.waiting_bytes == 0 and responded == [cmd] and bytes(slot.view) == reply
        await asyncio.sleep(0.1)  # the count's next look sees it, and the queue takes commands
        assert not c.deferring and c.queue.submitted == [b"\x02", b"\x01"] and not c.deferred
        assert c.unsent_total.total == 0 and not c.unsent_total.counted

    asyncio.run(main())
