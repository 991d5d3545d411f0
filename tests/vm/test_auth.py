"""NVMe in-band authentication (DH-HMAC-CHAP) against the Linux kernel, in the VM booted on the
bookworm 6.12 kernel package (VM_AUTH_KERNEL: the default 6.1 kernel has no NVMe auth).

Twins of tests/vm/guest_tests/test_auth.py; see docs/security.md.
"""

import pytest

pytestmark = pytest.mark.vm

GUEST_TESTS = "tests/vm/guest_tests/test_auth.py"
VM_TIMEOUT = 600
VM_AUTH_KERNEL = True


def test_khost_dhchap_sha256_null(guest_case):
    """nvme connect --dhchap-secret (SHA-256, NULL group) to blockd target, then I/O."""


def test_khost_dhchap_sha512_ffdhe2048_bidirectional(guest_case):
    """--dhchap-secret and --dhchap-ctrl-secret (SHA-512, ffdhe2048), then I/O."""


def test_khost_wrong_secret_refused(guest_case):
    """The kernel host with a wrong secret is refused by blockd target."""


def test_khost_missing_secret_refused(guest_case):
    """The kernel host without a secret is refused by blockd target."""


def test_our_host_dhchap_to_kernel_nvmet(guest_case):
    """blockd's host authenticates both ways to nvmet (dhchap_key, dhchap_ctrl_key,
    hmac(sha384), ffdhe3072 in configfs), then I/O lands in nvmet's backing file."""


def test_our_host_wrong_secret_refused_by_kernel_nvmet(guest_case):
    """nvmet refuses blockd's host with a wrong secret."""
