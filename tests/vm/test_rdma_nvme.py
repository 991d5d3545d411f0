"""NVMe/RDMA transport (target/rdma.py, initiator/rdma.py) over rxe in one VM boot.

Twins of tests/vm/guest_tests/test_rdma_nvme.py.
"""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/vm/guest_tests/test_rdma_nvme.py"
VM_TIMEOUT = 900  # the group took 532 s of 600 once the limits test was added


def test_blockd_host_blockd_target(guest_case):
    """blockd host -> blockd target: 2 I/O queues, ~100 commands in flight, write/read/verify."""


def test_khost_rdma_blockd_target(guest_case):
    """kernel nvme-rdma host -> blockd target: identify, fio write+verify, disconnect."""


def test_khost_ext4_write_bursts(guest_case):
    """kernel nvme-rdma host -> blockd target: ext4, rounds of small-file bursts + sync; no packet
    dropped (rxe send_err, backlog), no queue failure or error recovery in dmesg (but the host
    rxe's own MR bug, reported); files intact after remount, fsck clean; teardown causes logged."""


def test_blockd_host_kernel_target(guest_case):
    """blockd host -> kernel nvmet-rdma target: write/read/verify."""


def test_hostile_host(guest_case):
    """bad lengths -> NVMe errors; bad keys/addresses -> that queue torn down; others unharmed."""


def test_hostile_host_limits(guest_case):
    """CM connect requests past max_connections_per_host or rdma_recv_total rejected (No
    Resources); a queue sending no Connect closed after hello_timeout, counts released; a good
    host does verified I/O throughout."""


def test_service_rdma_port(guest_case):
    """`blockd target --config` with an rdma port: blockctl discover/connect/write/read over RDMA,
    the kernel nvme-rdma host reads and writes; clean SIGTERM."""


def test_a_replica_over_rdma_gets_every_write_and_a_resync_after_a_kill(guest_case):
    """A blockd primary whose replica is a blockd target over NVMe/RDMA: full sync, kernel-host
    verified writes, the replica killed and brought back by a bitmap resync over RDMA, verify by
    digests 0 differ, the data areas equal."""
