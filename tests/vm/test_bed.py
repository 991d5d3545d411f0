"""The test bed's own smoke tests: rxe + perftest, kernel NVMe-oF host against kernel target.

One VM boot runs tests/vm/guest_tests/test_bed.py; each test below reports its twin.
"""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/vm/guest_tests/test_bed.py"
VM_TIMEOUT = 420


def test_rxe_devices(guest_case):
    """rxe0 on veth0 and rxe1 on veth1 come up ACTIVE."""


def test_ib_write_bw(guest_case):
    """perftest ib_write_bw rxe1 -> rxe0 over rdma_cm reports a bandwidth."""
    bw = float(guest_case.properties["bw_average_MBps"])
    assert bw > 0
    print(f"ib_write_bw over rxe: {bw} MB/s average")


def test_kernel_nvme_tcp(guest_case):
    """kernel nvme-tcp host -> kernel nvmet-tcp target: connect, fio write+verify, read back."""


def test_kernel_nvme_rdma(guest_case):
    """kernel nvme-rdma host (rxe1) -> kernel nvmet-rdma target (rxe0): write, read back."""
