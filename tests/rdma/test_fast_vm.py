"""The verbs fast path over real rxe, both implementations: an RC pair in one asyncio process.

Each run connects a fresh RC pair (rdma_cm, rxe1 -> rxe0) with the QPs' and CQs' fast path set to
the ctypes reference or the compiled module, and moves data only through the fast path's own
calls: receive chains (``post_recvs``), a chained RDMA WRITE + SEND (``post_sends``), an RDMA READ,
completion events taken off the channel, re-arming and polling (``CompletionQueue.drain``), and
the events' acknowledgement at close. Both runs must see the same completions (wr_id, status,
opcode, byte_len) in the same order, and the bytes must arrive.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = pytest.mark.vm

PORT = 4920 + (os.getpid() % 500)
N_RECV = 8
PAYLOAD = 6000


class Side:
    """One end: device, CQ, registered receive/send/data pools, completions in arrival order."""

    def __init__(self, dev_name: str, loop) -> None:
        from blockd.rdma.verbs import ACCESS_REMOTE, open_device
        self.dev = open_device(dev_name)
        self.cq = self.dev.create_cq(64)
        self.recv = self.dev.create_pool(256, N_RECV)
        self.send = self.dev.create_pool(256, 4)
        self.data = self.dev.create_pool(8192, 2, ACCESS_REMOTE)
        self.wcs: list = []
        self.arrived = asyncio.Event()
        self.cq.attach(loop, self._got)
        self.qp = None

    def _got(self, wcs: list) -> None:
        self.wcs.extend(wcs)
        self.arrived.set()

    def make_qp(self, dev_name: str):
        self.qp = self.dev.create_qp(self.cq, max_send_wr=16, max_recv_wr=N_RECV)
        return self.qp

    def post_recvs(self, qp) -> None:
        qp.post_recvs([(100 + s.index, *s.sge()) for s in self.recv.slots])

    async def wc(self, wr_id: int):
        """The first completion of ``wr_id``, once it is there."""
        while True:
            for w in self.wcs:
                if w.wr_id == wr_id:
                    assert w.status == 0, w
                    return w
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 20)

    async def count(self, n: int) -> None:
        """Until ``n`` completions arrived."""
        while len(self.wcs) < n:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 20)


async def _pair_run(impl, port: int) -> list:
    from protocol import rdma_cm as pcm
    from blockd.rdma.abi import SEND_SIGNALED, WR_RDMA_READ, WR_RDMA_WRITE, WR_SEND
    from blockd.rdma.cm import CmEventChannel, connect

    loop = asyncio.get_running_loop()
    ch = CmEventChannel()
    listener = ch.listen("192.0.2.1", port)
    server, client = Side("rxe0", loop), Side("rxe1", loop)
    assert type(server.cq.fast) is impl.FastCQ and type(client.cq.fast) is impl.FastCQ

    async def accept():
        req = await listener.get_request()
        return req.accept_nvme(server.make_qp(req.dev_name), crqsize=N_RECV,
                               before_rtr=server.post_recvs)

    acc = asyncio.create_task(accept())
    cconn = await connect(ch, "192.0.2.1", port, client.make_qp,
                          pcm.ConnectRequest(qid=1, hrqsize=N_RECV, hsqsize=N_RECV - 1).pack(),
                          before_rtr=client.post_recvs)
    sconn = await acc
    await asyncio.wait_for(sconn.established, 20)
    assert type(server.qp.fast) is impl.FastQP and type(client.qp.fast) is impl.FastQP

    # the server tells the client where to write: its data slot's address and rkey
    dst, src = server.data.slots[0], client.data.slots[0]
    msg = server.send.slots[0]
    msg.view[:12] = dst.addr.to_bytes(8, "little") + dst.rkey.to_bytes(4, "little")
    server.qp.post_sends([(1, WR_SEND, SEND_SIGNALED, *msg.sge(12), 0, 0, 0)])
    got = await client.wc(100)
    raddr = int.from_bytes(client.recv.slots[0].view[:8], "little")
    rkey = int.from_bytes(client.recv.slots[0].view[8:12], "little")
    assert (raddr, rkey, got.byte_len) == (dst.addr, dst.rkey, 12)

    # the client: RDMA WRITE (unsignalled) + SEND chained in one post, as the target replies
    pattern = bytes((i * 13 + 1) & 0xFF for i in range(PAYLOAD))
    src.view[:PAYLOAD] = pattern
    note = client.send.slots[0]
    note.view[:4] = b"done"
    client.qp.post_sends([(2, WR_RDMA_WRITE, 0, *src.sge(PAYLOAD), 0, raddr, rkey),
                          (3, WR_SEND, SEND_SIGNALED, *note.sge(4), 0, 0, 0)])
    await client.wc(3)
    await server.wc(100)
    assert bytes(server.recv.slots[0].view[:4]) == b"done"
    assert bytes(dst.view[:PAYLOAD]) == pattern  # the WRITE landed before the SEND

    # the server reads it back from the client with an RDMA READ into its second slot
    back = server.data.slots[1]
    server.qp.post_sends([(4, WR_RDMA_READ, SEND_SIGNALED, *back.sge(PAYLOAD), 0, src.addr,
                           src.rkey)])
    assert (await server.wc(4)).byte_len == PAYLOAD
    assert bytes(back.view[:PAYLOAD]) == pattern

    # the used receive reposted (as the target does), then every posted receive used, in order
    server.qp.post_recvs([(100, *server.recv.slots[0].sge())])
    for i in range(N_RECV):
        note.view[:4] = i.to_bytes(4, "little")
        client.qp.post_sends([(10 + i, WR_SEND, SEND_SIGNALED, *note.sge(4), 0, 0, 0)])
        await client.wc(10 + i)
    await server.count(3 + N_RECV)
    assert [bytes(server.recv.slots[(i + 1) % N_RECV].view[:4]) for i in range(N_RECV)] == \
        [i.to_bytes(4, "little") for i in range(N_RECV)]
    # every batch came through the channel: events taken and, fewer than ACK_EVERY, not yet
    # acknowledged (the CQs' close acknowledges them; ibv_destroy_cq would hang otherwise)
    assert server.cq.fast.unacked > 0 and client.cq.fast.unacked > 0

    seen = [[(w.wr_id, w.status, w.opcode, w.byte_len) for w in side.wcs] for side in (server, client)]
    cconn.disconnect()
    await asyncio.wait_for(cconn.closed, 20)
    await asyncio.wait_for(sconn.closed, 20)
    cconn.close()
    sconn.close()
    listener.close()
    ch.close()
    return seen


@pytest.mark.timeout(240)
def test_rc_pair_through_both_fast_paths(rxe_pair, monkeypatch):
    from blockd.rdma import _fast, _fast_verbs, verbs

    runs = []
    for k, impl in enumerate((_fast, _fast_verbs)):
        monkeypatch.setattr(verbs, "_impl", impl)
        runs.append(asyncio.run(asyncio.wait_for(_pair_run(impl, PORT + k), 150)))
        verbs.close_devices()  # the CQs' close takes the last events and acknowledges them all
    server, client = runs[0]
    assert [w[0] for w in server] == [1, 100, 4, *range(101, 100 + N_RECV), 100]
    assert [w[0] for w in client] == [100, 3, *range(10, 10 + N_RECV)]
    assert runs[1] == runs[0]


def test_fast_path_selection_in_the_guest(record_property):
    """The guest runs the path the host asked for (tests/vm/harness.py passes BLOCKD_PURE on)."""
    from blockd.rdma import verbs
    pure = os.environ.get("BLOCKD_PURE", "") not in ("", "0")
    record_property("fast_path", verbs.FAST_PATH)
    assert verbs.FAST_PATH.startswith("ctypes (BLOCKD_PURE") if pure else verbs.FAST_PATH == "compiled"
