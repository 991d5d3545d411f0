"""nvme-cli's habits in blockctl and blockd's discovery, against the kernel host and nvmet in the
VM (issue 39). Twins of tests/vm/guest_tests/test_nvmecli.py (one boot for the file)."""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/vm/guest_tests/test_nvmecli.py"
VM_TIMEOUT = 900


def test_json_as_nvme_cli_prints_it_nvmet(guest_case):
    """blockctl discover/id-ctrl/id-ns/list -o json == nvme-cli -o json, for nvmet's subsystem."""


def test_json_as_nvme_cli_prints_it_blockd(guest_case):
    """The same for blockd's target."""


def test_khost_discover_on_8009_finds_the_volume(guest_case):
    """nvme discover on blockd's listing port 8009 names the subsystem at port 4420."""


def test_khost_discover_referral(guest_case):
    """nvme discover on the referring port shows nvmet's referral entry."""


def test_khost_connect_all_listing(guest_case):
    """nvme connect-all through the listing port (8009) connects the volume once."""


def test_khost_connect_all_referral(guest_case):
    """nvme connect-all following the referral (8010) connects the volume once."""


def test_connect_all_from_discovery_conf(guest_case):
    """/etc/nvme/discovery.conf serves nvme connect-all and blockctl connect-all."""


def test_error_statuses_as_nvmet(guest_case):
    """Malformed admin and I/O commands from nvme-cli: blockd's status and error-log entry ==
    nvmet's, but for the documented differences (docs/wire-facts.md)."""
    print((guest_case.results / "error-statuses.txt").read_text())


def test_raw_command_statuses_as_nvmet(guest_case):
    """test_hostile's raw malformed commands against nvmet: its statuses == blockd's, but the
    documented differences."""
    print((guest_case.results / "raw-statuses.txt").read_text())
