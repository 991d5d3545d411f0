"""rxe add/list/del through blockd.rdma.rxe (pyroute2 NLDEV), in the VM."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vm

NETDEV = "blkdrxe0"
NAME = "blkdtest"


@pytest.fixture
def dummy_netdev(rdma_env):
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        if ipr.link_lookup(ifname=NETDEV):
            ipr.link("del", ifname=NETDEV)
        ipr.link("add", ifname=NETDEV, kind="dummy")
        idx = ipr.link_lookup(ifname=NETDEV)[0]
        ipr.link("set", index=idx, state="up")
    yield NETDEV
    with IPRoute() as ipr:
        if ipr.link_lookup(ifname=NETDEV):
            ipr.link("del", ifname=NETDEV)


def test_rxe_add_list_del(dummy_netdev):
    from blockd.rdma import rxe
    assert NAME not in {l.dev for l in rxe.list_rdma_links()}
    assert rxe.add_rxe(dummy_netdev, NAME) == NAME
    try:
        links = {l.dev: l for l in rxe.list_rdma_links()}
        assert NAME in links, links
        assert links[NAME].netdev == dummy_netdev
        assert links[NAME].port == 1
        with pytest.raises(rxe.RxeError, match="already exists"):
            rxe.add_rxe(dummy_netdev, NAME)
    finally:
        rxe.del_rxe(NAME)
    assert NAME not in {l.dev for l in rxe.list_rdma_links()}
    with pytest.raises(rxe.RxeError, match="does not exist"):
        rxe.del_rxe(NAME)


def test_rxe_errors_and_cli(rdma_env, capsys):
    from blockd.rdma import rxe
    with pytest.raises(rxe.RxeError, match="network device 'nosuchdev0' does not exist"):
        rxe.add_rxe("nosuchdev0")
    assert rxe.rxe_main(["add", "nosuchdev0"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert rxe.rxe_main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(line.startswith("link ") for line in out.splitlines())
