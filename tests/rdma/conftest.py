"""Guest-side RDMA tests: run in the qemu VM bed with rxe (see tests/rdma/README or the rdmavm tool).

Tests marked ``vm`` need Soft-RoCE: ``rxe_pair`` further needs the two rxe devices of the
reference ``rxe-up.sh`` (rxe0 on veth0 192.0.2.1, rxe1 on veth1 192.0.2.2, RXE_MODE=pair).
Everywhere else they skip with the reason.
"""

from __future__ import annotations

import os

import pytest

RXE_ADDR0 = os.environ.get("RXE_ADDR0", "192.0.2.1")
RXE_DEV0 = os.environ.get("RXE_DEV0", "rxe0")
RXE_DEV1 = os.environ.get("RXE_DEV1", "rxe1")


def rdma_skip_reason() -> str | None:
    if not os.path.isdir("/sys/class/infiniband"):
        return "no /sys/class/infiniband: not in a VM with RDMA (run under the rdmavm test bed)"
    if os.geteuid() != 0:
        return "RDMA VM tests need root"
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as e:
        return f"pyverbs not importable ({e}); use a venv with --system-site-packages"
    return None


@pytest.fixture
def rdma_env():
    reason = rdma_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def rxe_pair(rdma_env):
    """(server_dev, client_dev, server_addr) of rxe-up.sh's veth pair; skips if absent."""
    devs = set(os.listdir("/sys/class/infiniband"))
    if not {RXE_DEV0, RXE_DEV1} <= devs:
        pytest.skip(f"need rxe devices {RXE_DEV0} and {RXE_DEV1} (source rxe-up.sh); have {sorted(devs)}")
    yield RXE_DEV0, RXE_DEV1, RXE_ADDR0
    from blockd.rdma.verbs import close_devices
    close_devices()
