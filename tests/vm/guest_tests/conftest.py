"""Fixtures for the tests that run inside the VM (collected only there: BLOCKD_VM=1)."""

from __future__ import annotations

import os

import pytest

from .util import ADDR0, GUEST, IN_VM, RESULTS, sh


def pytest_collection_modifyitems(config, items):
    if IN_VM:
        return
    for item in items:
        if "guest_tests" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason="runs only inside the VM (BLOCKD_VM=1)"))


@pytest.fixture(scope="session")
def results():
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS


@pytest.fixture(scope="session")
def rxe():
    """veth0 192.0.2.1 <-> veth1 192.0.2.2 with rxe0/rxe1 on them (pair mode routing)."""
    sh(f"bash {GUEST / 'rxe-up.sh'}; rdma link show; ip -br addr", timeout=120)
    return {"dev0": "rxe0", "dev1": "rxe1", "addr0": ADDR0, "addr1": "192.0.2.2"}


@pytest.fixture
def nvmet():
    """The kernel nvmet target; everything configured in the test is torn down after it."""
    sh("nvmet_init")
    yield
    # disconnect any host still attached before removing the target
    sh("for c in /sys/class/nvme-fabrics/ctl/nvme*; do [ -e \"$c\" ] || continue; "
       "nvme disconnect -d \"$(basename \"$c\")\" || true; done; nvmet_teardown", check=False)


@pytest.fixture
def scratch(tmp_path_factory):
    """A scratch directory on the guest's RAM (/dev/shm, tmpfs)."""
    d = tmp_path_factory.mktemp("scratch", numbered=True)
    p = f"/dev/shm/{os.getpid()}-{d.name}"
    os.makedirs(p, exist_ok=True)
    return p
