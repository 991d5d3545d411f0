"""blockd against the Linux kernel's NVMe-oF host and target, in the VM (one boot for all).

Twins of tests/vm/guest_tests/test_blockd.py.  Skipped until blockd's CLI entry points
(blockd.cli.daemon, blockd.cli.blockctl) exist.
"""

import importlib.util
import os

import pytest


def _blockd_cli_missing() -> str | None:
    for mod in ("blockd.cli.daemon", "blockd.cli.blockctl"):
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except ImportError:
            return mod
    return None


# BLOCKD_VM_FORCE=1 runs them anyway (to exercise the bed while the core is being written)
_missing = None if os.environ.get("BLOCKD_VM_FORCE") == "1" else _blockd_cli_missing()
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(_missing is not None,
                       reason=f"blockd core not there yet ({_missing} is missing)"),
]

GUEST_TESTS = "tests/vm/guest_tests/test_blockd.py"
VM_TIMEOUT = 1080  # 900 before the io_uring case, which took 159 s of its own (2026-12-07, TCG)


# kernel nvme-tcp host -> `blockd target`
def test_khost_connect_and_list(guest_case):
    """nvme connect -t tcp to blockd's target; nvme list shows our model and serial."""


def test_khost_id_ctrl(guest_case):
    """nvme id-ctrl: serial, model and subnqn are blockd's."""


def test_khost_id_ns(guest_case):
    """nvme id-ns: 64 MiB of 512-byte blocks."""


def test_khost_fio_write_verify(guest_case):
    """fio 16 MiB write + crc32c verify through /dev/nvmeXn1; the backing file matches."""


def test_khost_libaio_queue_depth_verify(guest_case):
    """fio libaio, queue depth 16, random 4-16 KiB writes with verify."""


def test_khost_discard_write_zeroes_flush_reach_the_backend(guest_case):
    """blkdiscard, blkdiscard -z and fsync reach the backend (strace on the target) and read back."""


def test_khost_1mib_writes_take_the_r2t_path(guest_case):
    """1 MiB writes with verify, larger than the in-capsule limit: the R2T path."""


def test_khost_dsync_writes_go_out_as_fua(guest_case):
    """O_DSYNC direct writes with verify: Writes with FUA from the kernel host."""


def test_khost_disconnect(guest_case):
    """nvme disconnect."""


def test_blockctl_reads_what_khost_wrote(guest_case):
    """blockctl reads back through blockd's target the bytes the kernel host wrote."""


# blockctl -> kernel nvmet-tcp target
def test_blockctl_kernel_target_identify(guest_case):
    """blockctl id-ctrl / id-ns against the kernel target."""


def test_blockctl_kernel_target_write_read(guest_case):
    """blockctl write a pattern, read it back (file and stdout), backing file matches."""


# kernel nvme-tcp host -> `blockd target`: digests, 4 KiB blocks
def test_khost_header_and_data_digests(guest_case):
    """nvme connect -g -G, then writes with verify."""


def test_khost_4096_byte_blocks(guest_case):
    """A 4096-byte-block namespace: logical block size, libaio write with verify."""


# nvme-cli's view of blockd beside the kernel's nvmet
def test_discover_tcp_port_lists_its_own_entries(guest_case):
    """nvme discover over TCP: TCP entries only, TREQ "sq flow control disable supported"."""


def test_discover_rdma_port_lists_its_own_entries(guest_case):
    """nvme discover over RDMA (rxe): RDMA entries only."""


def test_discover_treq_as_nvmet(guest_case):
    """TREQ as the kernel's nvmet-tcp port says it."""


def test_ctratt_and_error_statuses_as_nvmet(guest_case):
    """CTRATT 0x41; failing admin commands' statuses (More bit) and error-log entries as nvmet's."""


# kernel nvme-tcp host -> `blockd target`: online resize
def test_khost_sees_a_namespace_grow_without_reconnecting(guest_case):
    """truncate + SIGHUP, then blockctl target resize: blockdev --getsize64 and nvme id-ns show
    each new size on the same controller (the Namespace Attribute Changed event)."""


def test_khost_rides_through_reloads_that_reopen_its_namespace(guest_case):
    """fio QD16 verify through reloads that close and open the namespace again (its path moved
    between a file and a hard link): no fio error, same controller and device (Internal Path
    Error to the commands in between, which the kernel host sends again)."""


def test_blockd_primary_replicates_to_a_kernel_nvmet_namespace(guest_case):
    """A blockd replicated namespace (4 KiB blocks) whose replica is a kernel nvmet-tcp namespace:
    full sync on first contact, a blockctl write is on the kernel's file once acknowledged, verify
    finds 0 differences, blockd's replication metadata sits at the end of the kernel's namespace."""


def test_overlapping_writes_leave_the_kernel_replica_equal(guest_case):
    """Four hosts writing the same blocks at once (256 in flight, every other one FUA) through
    the blockd primary: the kernel nvmet replica ends equal to the primary's copy (issue 35)."""



def test_a_file_system_made_before_replication_survives_internal_metadata(guest_case):
    """ext4 made before replication, within the data area create-md leaves; blockctl target
    create-md; a kernel nvmet replica's full sync; the kernel host mounts it through the primary
    and writes; e2fsck clean and the files equal on both copies (issue 41)."""


def test_a_file_system_made_before_replication_survives_external_metadata(guest_case):
    """The same with external metadata (metadata_path): the file system spans the whole volume."""


# kernel nvme-tcp host -> `blockd target` with its queue threads on io_uring (issue 42)
def test_khost_io_uring_target_answers_as_the_thread(guest_case):
    """fio verify at QD1 and QD16 through a target on io_uring; the same bytes read back through
    the thread fallback; the ring really served (its log and its queues' counts)."""
