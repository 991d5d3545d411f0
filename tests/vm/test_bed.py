"""The test bed's own smoke tests (rxe + perftest, kernel NVMe-oF host against kernel target)
and blockd's RDMA layer (rdma_cm + QPs + pools, pyroute2 rxe links), in one VM boot.

Each test below reports its twin in one of the GUEST_TESTS files.
"""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = ("tests/vm/guest_tests/test_bed.py", "tests/rdma/test_cm_vm.py", "tests/rdma/test_rxe_vm.py")
VM_TIMEOUT = 600


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


def test_ping_pong_write_read(guest_case):
    """SEND ping-pong, RDMA WRITE and READ into the peer's pool slot, bad rkey, disconnect."""


def test_reject_with_private_data(guest_case):
    """reject with NVMe-oF STS reaches the connector; malformed RECFMT reported."""


def test_rxe_add_list_del(guest_case):
    """add an rxe link on a dummy netdev, list it, delete it."""


def test_rxe_errors_and_cli(guest_case):
    """missing netdev error, CLI exit codes, list output."""
