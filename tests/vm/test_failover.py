"""Failover with ANA, the Linux kernel's native multipath as judge (one boot for all).

Twins of tests/vm/guest_tests/test_failover.py: two ``blockd target`` processes present one
subsystem, a replicated pair (each its own file, each the other's replica); the kernel host
connects to both; the primary is killed under fio with verify, then under ext4, and the
standby promoted with ``blockctl target ana promote``; the old primary returns as the standby
and gets a bitmap resync.
"""

import pytest

pytestmark = [pytest.mark.vm]

GUEST_TESTS = "tests/vm/guest_tests/test_failover.py"
VM_TIMEOUT = 1200


def test_khost_one_subsystem_two_paths(guest_case):
    """nvme list-subsys: one subsystem with two paths; each path's ANA state; one block device."""


def test_khost_follows_a_namespace_moved_to_another_group(guest_case):
    """A reload moves the namespace to ANA group 2 and back: same device and controllers, each
    path's ana_grpid follows, its ANA state stays, the data stays and writes go through."""


def test_khost_fio_verify_survives_primary_kill(guest_case):
    """fio with crc32c verify; kill -9 the primary, promote the standby: fio ends without error."""


def test_khost_ext4_survives_standby_takeover(guest_case):
    """The old primary back as standby, resynced from the bitmaps; ext4 under writes; kill -9 the new primary, promote the
    old one: no write error, files intact, e2fsck clean."""
