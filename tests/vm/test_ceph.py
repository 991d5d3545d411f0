"""blockd as an RBD gateway pair with the Linux kernel's native multipath as the host (one boot).

Twins of tests/vm/guest_tests/test_ceph.py: the single-node Ceph cluster of tests/ceph runs
inside the guest (the guest shares this machine's userland), two ``blockd target`` processes
export one image with ``failover = true``, the kernel host connects to both; fio with verify
runs through kill -9, then SIGSTOP/SIGCONT, of the active gateway, and the standby takes over by
itself (docs/ceph.md).
"""

import pytest

pytestmark = [pytest.mark.vm]

GUEST_TESTS = "tests/vm/guest_tests/test_ceph.py"
VM_TIMEOUT = 1200


def test_khost_rbd_one_subsystem_two_paths(guest_case):
    """One subsystem, two paths: A optimized (holding the image's lock), B inaccessible."""


def test_khost_rbd_fio_verify_through_kill_9(guest_case):
    """fio with crc32c verify; kill -9 of A; B fences A and goes optimized by itself: fio ends clean."""


def test_khost_rbd_fio_verify_through_sigstop(guest_case):
    """A back as the standby; fio with verify; SIGSTOP of B, A takes over, SIGCONT of B (a zombie):
    fio ends clean, B finds itself fenced and goes inaccessible."""


def test_khost_rbd_ext4_tree_fsck_sha256(guest_case):
    """ext4 on the pair's namespace through the kernel host: a copied tree, e2fsck -fn clean,
    sha256 equal after a remount."""
