"""blockd.rdma (CM + QP + pools over rxe0/rxe1) in one VM boot; twins of tests/rdma/test_cm_vm.py."""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/rdma/test_cm_vm.py"
VM_TIMEOUT = 420


def test_ping_pong_write_read(guest_case):
    """SEND ping-pong, RDMA WRITE and READ into the peer's pool slot, bad rkey, disconnect."""


def test_reject_with_private_data(guest_case):
    """reject with NVMe-oF STS reaches the connector; malformed RECFMT reported."""
