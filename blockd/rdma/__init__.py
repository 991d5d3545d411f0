"""Transport-independent RDMA layer of blockd (pyverbs 44 + small ctypes bindings).

Modules (import them explicitly; importing this package does not import pyverbs):

* :mod:`blockd.rdma.rxe` -- Soft-RoCE links over RDMA netlink with pyroute2
  (``add_rxe``, ``del_rxe``, ``list_rdma_links``, CLI ``rxe_main``).
* :mod:`blockd.rdma.verbs` -- devices (own Context + PD), asyncio-driven completion queues,
  RC queue pairs with post helpers, registered buffer pools.
* :mod:`blockd.rdma.cm` -- rdma_cm on an asyncio loop: listen/accept/reject with NVMe-oF
  private data, connect, disconnect, per-id event demultiplexing.
* :mod:`blockd.rdma._raw` -- raw pointers out of pyverbs objects and librdmacm via ctypes
  (the pyverbs 44 gaps: event fields, a CM id's peer address), with start-up layout checks.
* :mod:`blockd.rdma.netdev` -- the local IPv4 addresses with an RDMA device behind them
  (sysfs + pyroute2), which an RDMA listener may bind.

Typical target side::

    ch = CmEventChannel()                          # inside the running loop
    lst = ch.listen("192.0.2.1", 4420)
    req = await lst.get_request()                  # req.nvme: qid/hrqsize/hsqsize/cntlid
    dev = open_device(req.dev_name)
    cq = dev.create_cq(4 * depth); pool = dev.create_pool(64 + 4096, depth)
    qp = dev.create_qp(cq, max_send_wr=..., max_recv_wr=...)
    conn = req.accept_nvme(qp, crqsize=req.nvme.hsqsize + 1, before_rtr=post_receives)
    cq.attach(loop, on_completions)

Typical host side::

    conn = await connect(ch, "192.0.2.1", 4420, make_qp, ConnectRequest(qid, 32, 31).pack(),
                         before_rtr=post_receives)
"""
