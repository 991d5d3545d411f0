"""blockd.rdma.rxe (pyroute2 NLDEV) in one VM boot; twins of tests/rdma/test_rxe_vm.py."""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/rdma/test_rxe_vm.py"
VM_TIMEOUT = 300


def test_rxe_add_list_del(guest_case):
    """add an rxe link on a dummy netdev, list it, delete it."""


def test_rxe_errors_and_cli(guest_case):
    """missing netdev error, CLI exit codes, list output."""
