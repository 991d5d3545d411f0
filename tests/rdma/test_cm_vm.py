"""CM + QP + buffer pool over the two rxe devices of rxe-up.sh, in one asyncio process."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = pytest.mark.vm

PORT = 4420 + (os.getpid() % 500)


class CqWaiter:
    """Collect completions of a CompletionQueue; await them by wr_id."""

    def __init__(self, cq, loop):
        self.wcs = {}
        self.waiters = {}
        cq.attach(loop, self._got)

    def _got(self, wcs):
        for wc in wcs:
            fut = self.waiters.pop(wc.wr_id, None)
            if fut is not None and not fut.done():
                fut.set_result(wc)
            else:
                self.wcs[wc.wr_id] = wc

    async def wait(self, wr_id, timeout=20):
        if wr_id in self.wcs:
            return self.wcs.pop(wr_id)
        fut = self.waiters[wr_id] = asyncio.get_running_loop().create_future()
        return await asyncio.wait_for(fut, timeout)


def ok(wc):
    from blockd.rdma.verbs import WcError
    if wc.status != 0:
        raise WcError(wc)
    return wc


class Side:
    def __init__(self, dev_name, loop):
        from blockd.rdma.verbs import ACCESS_REMOTE, open_device
        self.dev = open_device(dev_name)
        self.cq = self.dev.create_cq(64)
        self.recv_pool = self.dev.create_pool(256, 8)
        self.send_pool = self.dev.create_pool(256, 8)
        self.data_pool = self.dev.create_pool(8192, 4, ACCESS_REMOTE)
        self.waiter = CqWaiter(self.cq, loop)
        self.qp = None

    def make_qp(self, dev_name):
        assert dev_name == self.dev.name
        self.qp = self.dev.create_qp(self.cq, max_send_wr=16, max_recv_wr=16)
        return self.qp

    def post_recvs(self, qp):
        for s in self.recv_pool.slots:
            qp.post_recv(1000 + s.index, *s.sge())

    async def recv(self, n):
        """The n-th receive's bytes (wr_id 1000+n)."""
        wc = ok(await self.waiter.wait(1000 + n))
        return bytes(self.recv_pool.slots[n].view[:wc.byte_len])

    async def send(self, wr_id, data):
        slot = self.send_pool.slots[wr_id % 8]
        slot.view[:len(data)] = data
        self.qp.post_send(wr_id, *slot.sge(len(data)))
        ok(await self.waiter.wait(wr_id))


@pytest.mark.timeout(180)
def test_ping_pong_write_read(rxe_pair):
    from protocol import rdma_cm as pcm
    import pyverbs.enums as e
    from blockd.rdma.cm import CmEventChannel, connect
    from blockd.rdma.verbs import wc_status_str

    server_dev, client_dev, addr = rxe_pair

    async def main():
        loop = asyncio.get_running_loop()
        ch = CmEventChannel()
        listener = ch.listen(addr, PORT)
        assert listener.dev_name == server_dev
        client = Side(client_dev, loop)
        server = Side(server_dev, loop)

        async def accept_one():
            req = await listener.get_request()
            assert req.dev_name == server_dev
            assert req.nvme == pcm.ConnectRequest(qid=1, hrqsize=8, hsqsize=7, cntlid=3)
            assert req.peer_responder_resources > 0  # the client offers RDMA READ service
            assert req.peer_initiator_depth == 0
            assert len(req.private_data) >= 32
            qp = server.make_qp(req.dev_name)
            return req.accept_nvme(qp, crqsize=req.nvme.hsqsize + 1, before_rtr=server.post_recvs)

        acc = asyncio.create_task(accept_one())
        cconn = await connect(ch, addr, PORT, client.make_qp,
                              pcm.ConnectRequest(qid=1, hrqsize=8, hsqsize=7, cntlid=3).pack(),
                              before_rtr=client.post_recvs)
        sconn = await acc
        assert cconn.dev_name == client_dev
        assert pcm.parse_accept(cconn.peer_private_data).crqsize == 8
        await asyncio.wait_for(sconn.established, 20)
        assert sconn.initiator_depth > 0, "server QP must be allowed RDMA READs"

        # SEND ping-pong, carrying the client's data slot address and rkey
        target = client.data_pool.slots[0]
        source = client.data_pool.slots[1]
        pattern_r = bytes((i * 7 + 3) & 0xFF for i in range(5000))
        source.view[:5000] = pattern_r
        msg = b"ping" + target.addr.to_bytes(8, "little") + target.rkey.to_bytes(4, "little") \
            + source.addr.to_bytes(8, "little")
        await client.send(1, msg)
        got = await server.recv(0)
        assert got == msg
        raddr = int.from_bytes(got[4:12], "little")
        rkey = int.from_bytes(got[12:16], "little")
        raddr_src = int.from_bytes(got[16:24], "little")
        await server.send(2, b"pong")
        assert await client.recv(0) == b"pong"

        # RDMA WRITE from the server into the client's slot, then a SEND that orders after it
        pattern_w = bytes((i * 13 + 1) & 0xFF for i in range(6000))
        sslot = server.data_pool.slots[0]
        sslot.view[:6000] = pattern_w
        server.qp.post_rdma_write(3, *sslot.sge(6000), rkey=rkey, raddr=raddr)
        ok(await server.waiter.wait(3))
        await server.send(4, b"written")
        assert await client.recv(1) == b"written"
        assert bytes(target.view[:6000]) == pattern_w

        # RDMA READ by the server from the client's other slot
        rslot = server.data_pool.slots[1]
        server.qp.post_rdma_read(5, *rslot.sge(5000), rkey=rkey, raddr=raddr_src)
        wc = ok(await server.waiter.wait(5))
        assert wc.byte_len == 5000
        assert bytes(rslot.view[:5000]) == pattern_r

        # a bad rkey fails the WRITE (and errors the QP) without touching the peer's memory;
        # done last since it kills the connection's QPs
        guard = client.data_pool.slots[2]
        guard.view[:] = b"\x5a" * guard.size
        server.qp.post_rdma_write(6, *sslot.sge(4096), rkey=rkey ^ 0x100, raddr=guard.addr)
        wc = await server.waiter.wait(6)
        assert wc.status == e.IBV_WC_REM_ACCESS_ERR, wc_status_str(wc.status)
        assert bytes(guard.view) == b"\x5a" * guard.size

        # graceful disconnect from the client; both sides see DISCONNECTED
        cconn.disconnect()
        await asyncio.wait_for(cconn.closed, 20)
        await asyncio.wait_for(sconn.closed, 20)
        cconn.close()
        sconn.close()
        listener.close()
        ch.close()

    asyncio.run(asyncio.wait_for(main(), 150))


@pytest.mark.timeout(120)
def test_reject_with_private_data(rxe_pair):
    from protocol import rdma_cm as pcm
    from blockd.rdma.cm import CmEventChannel, CmRejected, connect

    server_dev, client_dev, addr = rxe_pair

    async def main():
        loop = asyncio.get_running_loop()
        ch = CmEventChannel()
        listener = ch.listen(addr, PORT + 1)
        client = Side(client_dev, loop)

        async def reject_one():
            req = await listener.get_request()
            assert req.nvme.qid == 77
            req.reject_nvme(pcm.STS_INVALID_QID)

        rej = asyncio.create_task(reject_one())
        with pytest.raises(CmRejected) as ei:
            await connect(ch, addr, PORT + 1, client.make_qp,
                          pcm.ConnectRequest(qid=77, hrqsize=32, hsqsize=31).pack())
        await rej
        assert ei.value.status == 28  # IB_CM_REJ_CONSUMER_DEFINED
        assert ei.value.nvme == pcm.Reject(sts=pcm.STS_INVALID_QID)
        assert "invalid QID" in str(ei.value)
        assert client.qp.closed  # connect() closes the QP it had make_qp create

        # a malformed request is reported with the STS to answer
        async def reject_bad():
            req = await listener.get_request()
            assert req.nvme is None and req.nvme_error.sts == pcm.STS_INVALID_RECFMT
            req.reject_nvme(req.nvme_error.sts)

        rej = asyncio.create_task(reject_bad())
        with pytest.raises(CmRejected) as ei:
            await connect(ch, addr, PORT + 1, client.make_qp,
                          pcm.ConnectRequest(qid=1, hrqsize=32, hsqsize=31, recfmt=5).pack())
        await rej
        assert ei.value.nvme.sts == pcm.STS_INVALID_RECFMT
        listener.close()
        ch.close()

    asyncio.run(asyncio.wait_for(main(), 100))
