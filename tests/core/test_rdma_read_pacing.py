"""The RDMA target's READ pacing (target/rdma.py) without a device: the host's data is fetched in
pieces of at most READ_CHUNK, never more than READ_BYTES_IN_FLIGHT bytes nor initiator_depth
READs outstanding per queue, in command order, and each command's data is ready exactly once
when all its pieces are in (docs/rdma-read-pacing.md says why)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest

from blockd.rdma.abi import WR_RDMA_READ
from target import rdma
from target.rdma import READ_BYTES_IN_FLIGHT, READ_CHUNK, RdmaTargetConnection, RdmaCommand


@dataclass
class _Slot:
    addr: int
    lkey: int = 7
    view: memoryview = field(default_factory=lambda: memoryview(bytearray(1 << 20)))


@dataclass
class _Req:
    cid: int
    length: int
    sgl_address: int
    sgl_key: int = 0x1234
    data: memoryview | None = None


class _Queue:
    def __init__(self) -> None:
        self.ready: list[int] = []
        self.failed: list[int] = []
        self.teardown: tuple[str, dict[str, str]] | None = None

    def data_ready(self, req: _Req) -> None:
        assert req.data is not None and len(req.data) == req.length
        self.ready.append(req.cid)

    def data_failed(self, req: _Req) -> None:
        self.failed.append(req.cid)

    def note_teardown(self, cause: str, **detail: str) -> None:
        self.teardown = self.teardown or (cause, detail)


class _QP:
    def __init__(self) -> None:
        self.posted: list[tuple] = []

    def post_sends(self, wrs: list[tuple]) -> None:
        self.posted.extend(wrs)


class _CM:
    initiator_depth = 128


def _connection(budget: int = READ_BYTES_IN_FLIGHT) -> RdmaTargetConnection:
    """The READ path's state only, as __init__ sets it (no device, CM or core behind it)."""
    c = object.__new__(RdmaTargetConnection)
    c.cm, c.qp, c.queue = _CM(), _QP(), _Queue()
    c.peer, c.closing = "test", False
    c.reads_in_flight, c.read_bytes_free = 0, budget
    c.read_wait = collections.deque()
    c.tokens, c._next_token = {}, 0
    c.close = lambda: setattr(c, "closing", True)
    return c


def _submit(c: RdmaTargetConnection, cid: int, length: int) -> RdmaCommand:
    cmd = RdmaCommand(cid)
    cmd.req = _Req(cid, length, sgl_address=(cid + 1) << 32)
    c._read_slot(cmd, _Slot(addr=(cid + 1) << 24))
    return cmd


def _complete_all(c: RdmaTargetConnection) -> list[tuple]:
    """Complete posted READs oldest first, checking the bounds at every step; all posted WRs."""
    budget = c.read_bytes_free + sum(wr[4] for wr in c.qp.posted)  # none completed yet
    done = 0
    while done < len(c.qp.posted):
        outstanding = c.qp.posted[done:]
        assert len(outstanding) <= c.cm.initiator_depth
        assert sum(wr[4] for wr in outstanding) <= budget
        c._read_done(outstanding[0][0] & rdma.WR_ID_MASK, 0)
        done += 1
    return c.qp.posted


@pytest.mark.parametrize("budget", [READ_BYTES_IN_FLIGHT, 3 * READ_CHUNK])
def test_large_writes_are_read_in_bounded_pieces_in_order(budget: int) -> None:
    c = _connection(budget)
    sizes = {1: 1 << 20, 2: 4096, 3: 3 * READ_CHUNK + 512, 4: 1 << 20}
    for cid, n in sizes.items():
        _submit(c, cid, n)
    assert sum(wr[4] for wr in c.qp.posted) <= budget  # the rest wait
    posted = _complete_all(c)
    assert c.queue.ready == [1, 2, 3, 4] and not c.queue.failed
    assert c.read_bytes_free == budget and c.reads_in_flight == 0 and not c.tokens
    assert all(wr[1] == WR_RDMA_READ and wr[4] <= READ_CHUNK for wr in posted)
    for cid, n in sizes.items():  # each command's pieces cover its SGL exactly, local = remote
        pieces = [(wr[3] - ((cid + 1) << 24), wr[7] - ((cid + 1) << 32), wr[4])
                  for wr in posted if wr[7] >> 32 == cid + 1]
        assert [p[0] for p in pieces] == [p[1] for p in pieces]
        assert sum(p[2] for p in pieces) == n
        assert [p[0] for p in pieces] == [sum(q[2] for q in pieces[:i]) for i in range(len(pieces))]


def test_initiator_depth_bounds_small_reads() -> None:
    c = _connection()
    c.cm.initiator_depth = 3
    for cid in range(10):
        _submit(c, cid, 4096)
    assert len(c.qp.posted) == 3
    _complete_all(c)
    assert c.queue.ready == list(range(10))


def test_a_failed_piece_fails_its_command_once_and_names_the_cause() -> None:
    c = _connection()
    _submit(c, 1, 1 << 20)
    first = c.qp.posted[0][0] & rdma.WR_ID_MASK
    c._read_done(first, 12)
    assert c.queue.failed == [1] and not c.queue.ready
    cause, detail = c.queue.teardown
    assert cause == "completion error" and detail["wc"] == "RDMA READ"
    assert detail["wc_status"] == "IBV_WC_RETRY_EXC_ERR (12)"
    assert c.closing


class _Loop:
    def __init__(self) -> None:
        self.later: list = []

    def call_later(self, delay: float, fn):
        self.later.append((delay, fn))
        return fn


def test_a_flushed_piece_waits_for_the_event_that_explains_it() -> None:
    """A flush is a consequence: the host's DREQ read in the grace period names the cause."""
    c = _connection(2 * READ_CHUNK)  # two pieces of one command in flight
    c.loop, c._flush_timer = _Loop(), None
    _submit(c, 1, 1 << 20)
    tokens = [wr[0] & rdma.WR_ID_MASK for wr in c.qp.posted]
    c._read_done(tokens[0], 5)
    c._read_done(tokens[1], 5)
    assert c.queue.failed == [1] and not c.closing and len(c.loop.later) == 1
    c.queue.note_teardown("peer disconnect", cm_event="RDMA_CM_EVENT_DISCONNECTED")
    c.close()
    c.loop.later[0][1]()  # the grace period ends: nothing more to say
    assert c.queue.teardown[0] == "peer disconnect"


def test_a_flush_nothing_explains_is_named_after_the_grace() -> None:
    c = _connection()
    c.loop, c._flush_timer = _Loop(), None
    _submit(c, 1, 4096)
    c._read_done(c.qp.posted[0][0] & rdma.WR_ID_MASK, 5)
    assert not c.closing
    c.loop.later[0][1]()
    assert c.closing and c.queue.teardown == (
        "completion error", {"wc": "RDMA READ", "wc_status": "IBV_WC_WR_FLUSH_ERR (5)",
                             "cid": "1", "addr": hex(2 << 32), "key": "0x1234", "length": "4096"})
