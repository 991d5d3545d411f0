"""Guest-side RDMA tests: run inside a VM with Soft-RoCE.

Ways to run them:
* the project bed: ``.venv/bin/python -m pytest tests/vm/test_bed.py`` (host twins);
* by hand, in the same VM bed (or any VM that sets ``RDMAVM`` and ``RDMAVM_GUEST``, the
  directory holding ``rxe-up.sh``)::

      python -m tests.vm.harness run -t 600 -c '. $BLOCKD_VM_GUEST/rxe-up.sh
          .venv/bin/python -m pytest tests/rdma -m vm -p no:cacheprovider'

Tests marked ``vm`` need Soft-RoCE: ``rxe_pair`` further needs the two rxe devices of
``rxe-up.sh`` (rxe0 on veth0 192.0.2.1, rxe1 on veth1 192.0.2.2, RXE_MODE=pair); inside a VM
(``BLOCKD_VM``/``RDMAVM`` set) they are brought up with that script if missing.  The guest-only
files (``test_cm_vm.py``, ``test_rxe_vm.py``: named in ``tests/vm/test_bed.py``'s ``GUEST_TESTS``)
are not collected outside a guest (``tests/conftest.py``); a test here that still skips for want
of RDMA fails under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

RXE_ADDR0 = os.environ.get("RXE_ADDR0", "192.0.2.1")
RXE_DEV0 = os.environ.get("RXE_DEV0", "rxe0")
RXE_DEV1 = os.environ.get("RXE_DEV1", "rxe1")


def _in_vm_guest() -> bool:
    return bool(os.environ.get("BLOCKD_VM") or os.environ.get("RDMAVM"))


def _rxe_up_script() -> str | None:
    for var in ("BLOCKD_VM_GUEST", "RDMAVM_GUEST"):
        d = os.environ.get(var)
        if d and os.path.exists(os.path.join(d, "rxe-up.sh")):
            return os.path.join(d, "rxe-up.sh")
    return None


@pytest.fixture(scope="session", autouse=True)
def _vm_rxe_up():
    """In a VM guest without rxe devices yet, run rxe-up.sh once (test set-up only)."""
    script = _rxe_up_script()
    if _in_vm_guest() and script and os.geteuid() == 0 and not (
            os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")):
        subprocess.run(["bash", script], check=False, timeout=180)


def rdma_skip_reason() -> str | None:
    if not os.path.isdir("/sys/class/infiniband"):
        return "no /sys/class/infiniband: not in a VM with RDMA (run through tests/vm/test_bed.py)"
    if os.geteuid() != 0:
        return "RDMA VM tests need root"
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as e:
        return f"pyverbs not importable ({e}); use a venv with --system-site-packages"
    return None


@pytest.fixture
def rdma_env():
    reason = rdma_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def rxe_pair(rdma_env):
    """(server_dev, client_dev, server_addr) of rxe-up.sh's veth pair; skips if absent."""
    devs = set(os.listdir("/sys/class/infiniband"))
    if not {RXE_DEV0, RXE_DEV1} <= devs:
        pytest.skip(f"need rxe devices {RXE_DEV0} and {RXE_DEV1} (source rxe-up.sh); have {sorted(devs)}")
    yield RXE_DEV0, RXE_DEV1, RXE_ADDR0
    from blockd.rdma.verbs import close_devices
    close_devices()
