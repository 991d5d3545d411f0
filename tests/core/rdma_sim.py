"""An NVMe/RDMA host and device in process, for the RDMA target's own code (target/rdma.py).

:class:`FakeDevice` stands in for :class:`blockd.rdma.verbs.Device`: its pools are ordinary memory
with real addresses (so that what the target writes through ``Slot.view`` and what it posts by
address are the same bytes), its QP posts through the verbs data path of the running plane
(``blockd/rdma/_fast_verbs.pyx``, or the ctypes ``blockd/rdma/_fast.py`` under ``BLOCKD_PURE=1``)
onto the recording provider of ``tests/rdma/test_fast_path.py``, and its CQ hands the target's
completion callback to :class:`Host`. :class:`Host` plays the initiator's side of one queue: it
writes capsules into the receive buffers the target posted (in the order it posted them), answers
RDMA READs from its own buffers, takes RDMA WRITEs into them and the response SENDs, and hands
the target the completions of all that in batches, as a CQ poll would. Everything posted is
kept (``Host.wire``) for tests to compare.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import struct
from types import SimpleNamespace
from typing import Any, Callable

from blockd import dataplane
from blockd.rdma import _fast
from blockd.rdma.abi import WR_RDMA_READ, WR_RDMA_WRITE, WR_SEND, WR_SEND_WITH_INV
from blockd.rdma.verbs import BufferPool, Slot
from tests.rdma.test_fast_path import FakeProvider, _send_fields

_impl = dataplane.twin("blockd.rdma._fast_verbs")
_RECV = 1
HOST_BASE = 0x7F00_0000_0000
"""Where the host's buffers seem to be (a command's at ``HOST_BASE + cid << 21``, key ``0x10000 + cid``)."""


class FakePool(BufferPool):
    """A :class:`~blockd.rdma.verbs.BufferPool` over plain memory (no MR): same slots, same order."""

    def __init__(self, device: "FakeDevice", slot_size: int, count: int, access: int = 0) -> None:
        self.device = device
        self.slot_size, self.count, self.length = slot_size, count, slot_size * count
        self._mem = ctypes.create_string_buffer(self.length)
        self.base = ctypes.addressof(self._mem)
        self.lkey = self.rkey = device.next_key()
        self.view = memoryview(self._mem).cast("B")
        self.slots = [Slot(self, i, self.base + i * slot_size, self.view[i * slot_size:(i + 1) * slot_size])
                      for i in range(count)]
        self._free = list(reversed(self.slots))
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeCQ:
    def __init__(self) -> None:
        self.callback: Callable[[list], None] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[list], None]) -> None:
        self.callback = callback

    def detach(self) -> None:
        self.callback = None

    def close(self) -> None:
        self.callback = None


class FakeQP:
    """Posts through the running plane's FastQP onto a recording :class:`FakeProvider`."""

    def __init__(self, max_send: int, max_recv: int) -> None:
        self.provider = FakeProvider()
        self.fast = self.provider.make_qp(_impl, max_send, max_recv)
        self.closed = False

    def post_sends(self, wrs: list) -> None:
        self.fast.post_send(wrs)

    def post_recvs(self, wrs: list) -> None:
        self.fast.post_recv(wrs)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.provider.close()


class FakeDevice:
    name = "fake0"

    def __init__(self) -> None:
        self._key = 0x100
        self.qps: list[FakeQP] = []

    def next_key(self) -> int:
        self._key += 1
        return self._key

    def create_cq(self, depth: int) -> FakeCQ:
        return FakeCQ()

    def create_pool(self, slot_size: int, count: int, access: int = 0) -> FakePool:
        return FakePool(self, slot_size, count, access)

    def create_qp(self, cq: FakeCQ, *, max_send_wr: int, max_recv_wr: int) -> FakeQP:
        qp = FakeQP(max_send_wr, max_recv_wr)
        self.qps.append(qp)
        return qp


class FakeCM:
    initiator_depth = 16

    def __init__(self) -> None:
        self.closed = asyncio.get_running_loop().create_future()
        self.closed.set_result(None)

    def disconnect(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeRequest:
    """The CM connect request :class:`target.rdma.RdmaTargetConnection` accepts."""

    def __init__(self, qid: int, depth: int) -> None:
        self.nvme = SimpleNamespace(qid=qid, hsqsize=depth - 1, hrqsize=depth)
        self.dev_name = FakeDevice.name
        self.peer = ""
        self.listener = SimpleNamespace(addr="192.0.2.1")
        self.done = False

    def accept_nvme(self, qp: FakeQP, crqsize: int, before_rtr: Callable, on_disconnect: Callable) -> FakeCM:
        before_rtr(qp)
        self.done = True
        return FakeCM()


def wc(wr_id: int, status: int = 0, byte_len: int = 0) -> tuple:
    return _fast.Wc(wr_id, status, 0, 0, byte_len, 0, 17, 0, 0, 0, 0, 0, 0)


class Host:
    """The initiator's side of one RDMA queue (module docstring)."""

    def __init__(self, conn: Any, qp: FakeQP) -> None:
        self.conn = conn
        self.provider = qp.provider
        self.recvs: collections.deque[tuple[int, int, int]] = collections.deque()
        self.sends_seen = self.recvs_seen = 0
        self.mem: dict[int, bytearray] = {}
        """The host's buffers by key (their address: :data:`HOST_BASE` + cid << 21)."""
        self.wire: list[tuple] = []
        """Every work request the target posted, in order: ("recv", wr_id, length) and the
        send queue's fields, with the SEND's CQE and an RDMA WRITE's data."""
        self.responses: list[bytes] = []
        self.held: list[tuple] = []
        """SEND completions not yet given to the target (:meth:`step` ``hold``)."""
        self.pending: list[tuple] = []

    def buffer(self, cid: int, data: bytes | int) -> tuple[int, int]:
        """A buffer of the host's for command ``cid`` (its contents, or its size): address, key."""
        self.mem[0x10000 + cid] = bytearray(data) if isinstance(data, bytes) else bytearray(data)
        return HOST_BASE + (cid << 21), 0x10000 + cid

    def _host_range(self, raddr: int, rkey: int, length: int) -> tuple[bytearray, int] | None:
        buf = self.mem.get(rkey)
        off = raddr - HOST_BASE - ((rkey - 0x10000) << 21)
        if buf is None or off < 0 or off + length > len(buf):
            return None
        return buf, off

    def collect(self) -> None:
        """Take what the target posted since the last look."""
        p = self.provider
        for chain in p.recvs[self.recvs_seen:]:
            for raw, sge in chain:
                wr_id, = struct.unpack_from("<Q", raw)
                addr, length, _ = struct.unpack("<QII", sge)
                self.recvs.append((wr_id, addr, length))
                self.wire.append(("recv", wr_id, length))
        self.recvs_seen = len(p.recvs)
        for chain in p.sends[self.sends_seen:]:
            for wr_id, _, opcode, flags, imm, raddr, rkey, sge in _send_fields(chain):
                addr, length, _ = sge if sge else (0, 0, 0)
                if opcode == WR_RDMA_WRITE:
                    data = ctypes.string_at(addr, length)
                    self.wire.append(("write", wr_id, flags, raddr, rkey, length, data))
                    where = self._host_range(raddr, rkey, length)
                    if where is not None:
                        buf, off = where
                        buf[off:off + length] = data
                elif opcode == WR_RDMA_READ:
                    self.wire.append(("read", wr_id, flags, raddr, rkey, length))
                    where = self._host_range(raddr, rkey, length)
                    if where is None:
                        self.pending.append(wc(wr_id, 10, 0))  # IBV_WC_REM_ACCESS_ERR
                    else:
                        buf, off = where
                        ctypes.memmove(addr, bytes(buf[off:off + length]), length)
                        self.pending.append(wc(wr_id, 0, length))
                else:
                    assert opcode in (WR_SEND, WR_SEND_WITH_INV), opcode
                    cqe = ctypes.string_at(addr, length)
                    self.wire.append(("send", wr_id, opcode, flags, imm, cqe))
                    self.responses.append(cqe)
                    self.held.append(wc(wr_id, 0, length))
        self.sends_seen = len(p.sends)

    def capsule(self, sqe: bytes, data: bytes = b"") -> bool:
        """Put one capsule into the oldest receive buffer posted; False: none is posted."""
        self.collect()
        if not self.recvs:
            return False
        wr_id, addr, length = self.recvs.popleft()
        raw = sqe + data
        assert len(raw) <= length
        ctypes.memmove(addr, raw, len(raw))
        self.pending.append(wc(wr_id, 0, len(raw)))
        return True

    def step(self, hold: bool = False) -> bool:
        """Give the target one batch of completions (SEND completions stay ``held`` with
        ``hold``); False: there was none."""
        self.collect()
        batch = self.pending
        if not hold:
            batch += self.held
            self.held = []
        self.pending = []
        if not batch or self.conn.cq.callback is None:
            return False
        self.conn.cq.callback(batch)
        self.collect()
        return True


def open_queue(listener: Any, qid: int, depth: int) -> tuple[Any, Host]:
    """An RDMA queue of ``listener``'s target on a :class:`FakeDevice`, and its host (patch
    ``blockd.rdma.verbs.open_device`` to return that device first: :func:`patch_device`)."""
    from protocol.nvme import SQE_SIZE
    from target.rdma import RdmaTargetConnection, _inline_size
    creq = FakeRequest(qid, depth)
    recv_bytes = depth * (SQE_SIZE + _inline_size(qid))
    assert listener._admit("192.0.2.2", recv_bytes, "192.0.2.2:4420", qid)
    conn = RdmaTargetConnection(listener, creq, "192.0.2.2", recv_bytes)
    listener.connections.add(conn)
    return conn, Host(conn, conn.qp)


def patch_device(monkeypatch: Any, classes: list[tuple[int, int]] | None = None) -> FakeDevice:
    """Make the RDMA target open a :class:`FakeDevice` (with fresh data pools of ``classes``)."""
    import blockd.rdma.verbs
    import target.rdma
    dev = FakeDevice()
    monkeypatch.setattr(blockd.rdma.verbs, "open_device", lambda name: dev)
    monkeypatch.setattr(target.rdma, "_data_slots", {})
    if classes is not None:
        monkeypatch.setattr(target.rdma, "DATA_CLASSES", classes)
    return dev
