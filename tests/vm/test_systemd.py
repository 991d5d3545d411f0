"""blockd's systemd units under real systemd: the VM boots the host's systemd as PID 1.

Twins of tests/vm/guest_tests/test_systemd.py (one boot for all; ~1 min of that is the
systemd boot under TCG).  Run on its own with
``.venv/bin/python -m pytest tests/vm/test_systemd.py`` or leave it out with
``-m 'vm and not vm_systemd'``.
"""

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.vm_systemd]

GUEST_TESTS = "tests/vm/guest_tests/test_systemd.py"
VM_TIMEOUT = 420
VM_SYSTEMD = True


def test_start_active_only_when_listening(guest_case):
    """systemctl start blockd-target returns (active, Type=notify) only once the port accepts."""


def test_hosts_connect_and_write(guest_case):
    """kernel nvme-tcp host writes + reads back; blockd-initiator.service connects from its toml."""


def test_reload_adds_namespace_host_sees_it(guest_case):
    """systemctl reload adds namespace 2; the connected kernel host and blockd initiator see it."""


def test_kill9_restarts_and_hosts_finish_io(guest_case):
    """kill -9 of the daemon: systemd restarts it, the hosts reconnect, every acked write intact."""


def test_stop_drains_flushes_exits_0(guest_case):
    """systemctl stop during writes: Result=success, exit 0, acknowledged writes in the file."""


def test_watchdog_restarts_a_hung_daemon(guest_case):
    """SIGSTOP (a hung loop): no WATCHDOG=1 pings, systemd kills and restarts the daemon."""
