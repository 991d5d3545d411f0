"""The verbs fast path (blockd/rdma/_fast_verbs.pyx and its ctypes reference) over rxe, one VM boot.

Twins of tests/rdma/test_fast_vm.py. Run it once more with BLOCKD_PURE=1 to check that the guest
gets the host's choice (tests/vm/harness.py passes BLOCKD_PURE on).
"""

import os

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/rdma/test_fast_vm.py"
VM_TIMEOUT = 480


def test_rc_pair_through_both_fast_paths(guest_case):
    """An RC pair over rxe through the ctypes and the compiled fast path: receive chains, RDMA
    WRITE + SEND chained, RDMA READ, events, arming, polling; the same completions, the bytes."""


def test_fast_path_selection_in_the_guest(guest_case):
    """The guest's RDMA data path is the compiled one, or ctypes under the host's BLOCKD_PURE=1."""
    pure = os.environ.get("BLOCKD_PURE", "") not in ("", "0")
    assert guest_case.properties["fast_path"].startswith("ctypes") == pure
