"""The compiled FUSE loop calling the compiled lane in C (``FuseLoop._transfer`` ->
``IoLane._transfer`` -> ``TcpHostIo._send_now``) against the Python loop on a controller
without the lane: the same random FUSE request batches, target answers and association changes
(down and back, reconnects onto new queues while commands are in flight or parked, a queue whose
transport has closed and refuses, the controller failing, a rescan, another controller under the
mount's name), the same FUSE replies
in the same order and the same capsules on every queue, replaced ones included.

FSYNC requests are among them (a Flush through ``submit_io``).

``test_fuse_differential.py`` runs both loops on a fake controller with a Python ``transfer``
and ``test_lane_differential.py`` the lane without FUSE; here the C calls between them run."""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest

from blockd.tcp_pdu import PduWriter
from initiator import controller as controller_mod
from initiator.controller import Controller
from initiator.fuse.abi import OUT_HEADER
from initiator.fuse.session import MAX_BATCH, FuseSession
from protocol.nvme import CQE_FAST
from protocol.status import Status, to_wire
from protocol.tcp import PduFlags, PduType

from .conftest import run
from .test_fuse_loop import _fsync, _read, _write
from .test_lane_differential import MAX_TRANSFER, NAMESPACES, TABLES, _Clock, _controller, _feed, _reconnect

pytest.importorskip("initiator.fuse._loop", reason="compiled data plane not built")
if controller_mod.IoLane is None:
    pytest.skip("the controller runs the Python plane (BLOCKD_PURE)", allow_module_level=True)


class _LoopClock(_Clock):
    """The lane test's clock, and the running event loop for everything else (the Python
    paths' unaligned reads and writes await futures)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio.get_running_loop(), name)


class _Stack:
    """One mount on one controller: ``compiled`` the compiled loop and the lane, else both
    Python."""

    def __init__(self, compiled: bool, clock: _Clock) -> None:
        self.compiled = compiled
        self.clock = clock
        self.ctrl: Controller = _controller(compiled, clock)
        assert (self.ctrl.lane is not None) is compiled
        self.connections = {"c": self.ctrl}
        self.mount = FuseSession(self.connections, "c", "/nonexistent", 60.0, compiled=compiled)
        assert (self.mount.on_readable == self.mount.py_on_readable) is not compiled
        self.ours, self.kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setblocking(False)
        self.kernel.setblocking(False)
        self.mount.attach(ours_fd := self.ours.fileno())
        asyncio.get_running_loop().remove_reader(ours_fd)  # served by hand, as the bench does
        self.replaced: list[list[bytes]] = []  # what queues a reconnect replaced sent

    def serve(self, requests: list[bytes]) -> None:
        for raw in requests:
            while True:
                try:
                    self.kernel.send(raw)
                    break
                except BlockingIOError:  # big writes filled the pair: serve some first (alike in both)
                    self.mount.on_readable()
        for _ in range(-(-len(requests) // MAX_BATCH) + 1):
            self.mount.on_readable()

    def replace_controller(self) -> None:
        """Another controller under the mount's name (the loop must not keep the old one's
        lane); what the old one's queues sent stays compared."""
        self.replaced += [conn.transport.sent for conn in self.ctrl.io]
        self.ctrl = _controller(self.compiled, self.clock)
        self.connections["c"] = self.ctrl

    def replies(self) -> list[tuple[int, int, bytes]]:
        out = []
        while True:
            try:
                raw = self.kernel.recv(1 << 21)
            except BlockingIOError:
                return out
            length, err, unique = OUT_HEADER.unpack_from(raw)
            out.append((unique, err, raw[OUT_HEADER.size:]))

    def wire(self) -> list[list[bytes]]:
        return self.replaced + [conn.transport.sent for conn in self.ctrl.io]

    def close(self) -> None:
        self.ours.close()
        self.kernel.close()


def _request(rng: random.Random, unique: int) -> bytes:
    """A READ or WRITE on namespace 1 (512-byte blocks) or 2 (4 KiB), aligned or not, inside,
    across the end or outside, one command or more than ``MAX_TRANSFER``; or an FSYNC of
    namespace 1, 2 or 3 (which only some rescans find)."""
    if rng.random() < 0.15:
        return _fsync(unique, rng.choice([2, 3, 4]))
    nodeid = rng.choice([2, 2, 3])
    bs = NAMESPACES[nodeid - 1].block_size
    size = NAMESPACES[nodeid - 1].size
    length = rng.choice([bs, bs, 2 * bs, MAX_TRANSFER, MAX_TRANSFER + bs, 100])
    offset = rng.choice([bs * rng.randrange(size // bs), bs * rng.randrange(size // bs), size - bs, size, 7])
    raw = bytearray(_read(unique, offset, length) if rng.random() < 0.5 else _write(unique, offset, rng.randbytes(length)))
    raw[24:32] = nodeid.to_bytes(8, "little")  # IN_HEADER's nodeid
    return bytes(raw)


def _answer(rng: random.Random, stacks: list[_Stack], writer: PduWriter) -> None:
    """The target answers one command in flight, the same on both."""
    pending = [sorted(conn.queue.pending) for conn in stacks[0].ctrl.io]
    assert pending == [sorted(conn.queue.pending) for conn in stacks[1].ctrl.io]
    choices = [(k, cid) for k, cids in enumerate(pending) for cid in cids]
    if not choices:
        return
    k, cid = rng.choice(choices)
    cmd = stacks[0].ctrl.io[k].queue.get(cid)
    status = rng.choice([0, 0, 0, 0, int(Status.LBA_RANGE)])
    if cmd.data_in is not None and not status:
        raw = b"".join(bytes(b) for b in writer.data_pdu(PduType.C2H_DATA, cid, 0, 0, rng.randbytes(len(cmd.data_in)),
                                                        PduFlags.LAST_PDU | PduFlags.SUCCESS))
    else:
        raw = b"".join(writer.pdu(PduType.CAPSULE_RESP, CQE_FAST.pack(0, 0, 0, 0, cid, to_wire(status) if status else 0)))
    for stack in stacks:
        _feed(stack.ctrl.io[k], raw)


async def _run(seed: int) -> None:
    rng = random.Random(seed)
    clock = _LoopClock()
    stacks = [_Stack(True, clock), _Stack(False, clock)]
    writer = PduWriter()
    unique = 1
    try:
        for step in range(80):
            r = rng.random()
            if r < 0.4:
                requests = [_request(rng, unique + i) for i in range(rng.choice([1, 1, 2, MAX_BATCH + 1]))]
                unique += len(requests)
                for stack in stacks:
                    stack.serve(requests)
            elif r < 0.75:
                _answer(rng, stacks, writer)
            elif r < 0.8:
                for stack in stacks:  # the association goes down (new commands park)
                    stack.ctrl._set_live(False)
            elif r < 0.85:
                for stack in stacks:
                    stack.ctrl._set_live(True)
                    stack.ctrl._unpark()
            elif r < 0.9:
                queues = rng.choice([1, 2])
                for stack in stacks:  # in-flight commands parked, new queues, unparked
                    _reconnect(stack.ctrl, queues, MAX_TRANSFER, stack.replaced)
            elif r < 0.94:
                k = rng.randrange(len(stacks[0].ctrl.io))
                for stack in stacks:  # its transport is gone: the lane must not send on it
                    stack.ctrl.io[k].closed = True
            elif r < 0.97:
                exc = None if stacks[0].ctrl.failed is not None else ConnectionError("gave up")
                for stack in stacks:
                    stack.ctrl._set_failed(exc)
            elif r < 0.985:
                table = rng.choice(TABLES)
                for stack in stacks:
                    stack.ctrl._set_namespaces(dict(table))
            else:
                for stack in stacks:
                    stack.replace_controller()
            for _ in range(3):  # the Python paths' tasks (unaligned I/O) run their steps
                await asyncio.sleep(0)
            got = [(stack.replies(), stack.wire(), dict(stack.mount.inflight), len(stack.ctrl._parked_io))
                   for stack in stacks]
            assert got[0] == got[1], f"seed {seed}, step {step}"
    finally:
        for stack in stacks:
            stack.close()


@pytest.mark.parametrize("seed", range(60))
def test_compiled_loop_and_lane_answer_as_the_python_ones(seed: int) -> None:
    run(_run(seed))


def test_a_reconnect_inside_a_hold_sends_as_the_python_path() -> None:
    """``hold_sends``, a command sent by the lane's C hold/submit/release (it must stay in the
    held batcher), a reconnect (the old queues' commands parked and sent on the new ones), a
    second command, ``release_sends``: each queue's bytes, before and after the release, are the
    reference's."""
    async def main() -> list[list[Any]]:
        clock = _LoopClock()
        seen: list[list[Any]] = [[], []]
        for i, ctrl in enumerate([_controller(True, clock), _controller(False, clock)]):
            replaced: list[list[bytes]] = []
            ctrl.hold_sends()
            ctrl.transfer(False, 1, 0, memoryview(bytearray(512)), lambda exc: None)
            seen[i].append([list(c.transport.sent) for c in ctrl.io])  # held: nothing written yet
            _reconnect(ctrl, 1, MAX_TRANSFER, replaced)
            ctrl.transfer(True, 2, 4096, memoryview(bytearray(4096)), lambda exc: None)
            seen[i].append([list(c.transport.sent) for c in ctrl.io])
            ctrl.release_sends()
            seen[i].append([[list(s) for s in replaced], [list(c.transport.sent) for c in ctrl.io]])
        return seen

    seen = run(main())
    assert seen[0] == seen[1]
    assert seen[0][0] == [[], []]  # the hold held the lane's send too


def test_a_queue_that_refuses_gets_nothing_from_the_lane() -> None:
    """A closed first queue with room: the lane declines (as ``Controller._io_with_room`` does
    not skip it either) and the reference's answer stands, the same on both."""
    async def main() -> list[Any]:
        clock = _LoopClock()
        out = []
        for ctrl in [_controller(True, clock), _controller(False, clock)]:
            ctrl.io[0].closed = True
            log: list[Any] = []
            try:
                ctrl.transfer(False, 1, 0, memoryview(bytearray(512)), lambda exc: log.append(repr(exc)))
            except Exception as exc:
                log.append(type(exc).__name__)
            await asyncio.sleep(0)
            out.append((log, [c.transport.sent for c in ctrl.io], len(ctrl._parked_io)))
        return out

    out = run(main())
    assert out[0] == out[1]
