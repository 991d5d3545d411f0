"""The suite-wide CI rule of ``tests/conftest.py``, run on a real VM group in a child pytest: with
qemu unavailable the group skips, which passes on a laptop and fails under ``CI=true``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run_vm_group_without_qemu(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BLOCKD_VM", "RDMAVM")}
    env["BLOCKD_VM_QEMU"] = "/nonexistent"
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vm/test_bed.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_without_ci_a_missing_vm_bed_skips() -> None:
    result = _run_vm_group_without_qemu(ci=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skipped" in result.stdout and "failed" not in result.stdout


def test_under_ci_a_missing_vm_bed_fails() -> None:
    result = _run_vm_group_without_qemu(ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "skipped under CI=true" in result.stdout
    assert "/nonexistent" in result.stdout  # the skip's reason is kept


def _run_ceph_group_without_ceph(ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["BLOCKD_CEPH_PATH"] = "/nonexistent"
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ceph/test_rbd_backend.py", "-k", "land"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_without_ci_a_missing_ceph_skips_and_under_ci_fails() -> None:
    """The Ceph group (tests/ceph) follows the same rule as the VM bed."""
    laptop = _run_ceph_group_without_ceph(ci=False)
    assert laptop.returncode == 0 and "skipped" in laptop.stdout, laptop.stdout + laptop.stderr
    ci = _run_ceph_group_without_ceph(ci=True)
    assert ci.returncode == 1 and "skipped under CI=true" in ci.stdout, ci.stdout + ci.stderr
    assert "ceph-mon" in ci.stdout  # the reason names what is missing
