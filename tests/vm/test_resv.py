"""Persistent reservations (issue 38) against the Linux kernel host, in the VM booted on the
bookworm 6.12 kernel package (the bed's newest): ``nvme resv-*`` and the block layer's
``IOC_PR_*`` ioctls on /dev/nvmeXnY (as fence_mpath uses them) against ``blockd target``, with
blockd's host as the second host (its own host identifier).

Twins of tests/vm/guest_tests/test_resv.py; see docs/operations.md "Reservations".
"""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/vm/guest_tests/test_resv.py"
VM_TIMEOUT = 900
VM_AUTH_KERNEL = True


def test_khost_nvme_resv_commands_and_conflicts(guest_case):
    """nvme resv-register/acquire/report from the kernel host; blockd's host is refused writes
    under the kernel host's Write Exclusive, the kernel host's writes fail (EBADE) under
    blockd's host's, and both see each other in the report."""


def test_ioctl_preempt_and_abort_fences_a_writer_mid_load(guest_case):
    """IOC_PR_REGISTER and IOC_PR_RESERVE from the kernel host while dd writes; blockd's host
    preempts and aborts the kernel host's key: the running writer fails, blockd's writes land."""
