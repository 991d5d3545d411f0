"""blockd's host multipath judged by the kernel's nvmet and by a blockd replicated pair (issue
40; one boot for both).

Twin of tests/vm/guest_tests/test_multipath_nvmet.py: our host (FUSE mount, fio with crc32c
verify, four jobs of 10 writes/s) follows ANA changes under load, each step driven by the state
the host lists and the writes that went through after it, fio stopped when the steps are done.
1. nvmet exports one subsystem on two ports; the ANA states change through configfs, and a
   port is removed and added again.
2. Two blockd targets in the guest, A primary and B its replica: planned switch-over and
   switch-back with ``blockctl target ana demote``/``promote``, A killed with SIGKILL and B
   promoted, A back as the standby.
Each case checks fio's end (no error, no bad block), at most one ANA-status retry per path per
change, and that every ANA status was a retry or a command requeued with one; the counts are
printed here.

Measured (2026-12-07, qemu TCG, machine shared with other work): group wall 234.8 s (was
315.2 s with the nvmet case alone, fio 6,144 writes at 40 IOPS); nvmet case 87.4 s, pair case
91.1 s. nvmet: fio err=0; ANA statuses 2 (0x303, both at port 1's optimized -> change), 1
retry on port 1 and 1 command requeued with it, 0 on port 2, 0 path-loss retries. Pair: fio
err=0; no ANA status reached the host (each change's event came first), 4 path-loss retries
(the commands in flight at the kill -9), A resynced 8 MiB on its return.
Break shown for the pair case (the guest test run on loopback outside the VM, BLOCKD_VM=1):
with a path's states kept and not read again across its reconnect (initiator/multipath.py
_live_changed), it failed: A listed ('reconnecting', 'optimized') after its kill -9, never
'unknown'.
"""

import pytest

pytestmark = [pytest.mark.vm]

GUEST_TESTS = "tests/vm/guest_tests/test_multipath_nvmet.py"
VM_TIMEOUT = 900


def _counts(guest_case) -> None:
    props = guest_case.properties
    print(f"per path (port: count) ANA-status retries {props['ana_retries']}, requeued with them "
          f"{props['ana_requeued']}; ANA statuses {props['ana_statuses']}; path-loss retries "
          f"{props['path_retries']}")


def test_our_host_follows_nvmet_ana_changes_under_fio_verify(guest_case):
    """optimized -> change -> inaccessible -> optimized on each port, the non-optimized pair
    swapped, port 1 removed and re-added: fio verify ends without error, retries within the bound."""
    _counts(guest_case)


def test_our_host_follows_a_blockd_pair_under_fio_verify(guest_case):
    """Switch-over and switch-back (demote, promote), kill -9 of the primary and promotion of
    the standby, the old primary back as the standby: fio verify ends without error, retries
    within the bound."""
    _counts(guest_case)
