"""Suite-wide rules: guest-only files stay out of the host's collection, every guest test has a
host twin, and under ``CI=true`` a test that needs a real peer may not skip.

* A VM group's host module (``tests/vm/test_*.py``) names its guest files in ``GUEST_TESTS``;
  each guest test runs inside the VM and reports through the host test of the same name
  (``tests/vm/conftest.py``). Guest files, in ``tests/vm/guest_tests`` or elsewhere (the RDMA
  ones in ``tests/rdma``), are not collected on the host at all: there they could only skip,
  and they run anyway, inside the VM, through their twins. In a guest (``BLOCKD_VM`` or
  ``RDMAVM`` set, as ``tests/rdma/conftest.py`` reads it) they are collected as usual.
* A guest test without a host twin would never run: collecting its group is a usage error.
* CI must not go green without its peers: when qemu, ``/dev/fuse``, root, systemd or an RDMA
  device is missing, the tests that need them skip, which is right on a laptop and wrong in CI.
  Under ``CI=true`` such a skip (a test under ``tests/vm``, ``tests/fuse``, ``tests/systemd``
  or ``tests/rdma``, or marked ``vm``) is reported as a failure, with the skip's reason.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Iterator

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GUEST_DIR = TESTS / "vm" / "guest_tests"
"""The VM groups' own guest files and fixtures (their conftest expects the guest's tools)."""
IN_GUEST = bool(os.environ.get("BLOCKD_VM") or os.environ.get("RDMAVM"))
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
PEER_GROUPS = tuple(TESTS / group for group in ("vm", "fuse", "systemd", "rdma", "ceph"))
"""The test directories whose tests need a real peer (a VM, a FUSE mount, systemd, RDMA, a Ceph cluster)."""


def _guest_tests_of(host_module: Path) -> list[Path]:
    """The files a VM group's host module names in ``GUEST_TESTS`` (read from its source, so the
    host module need not be importable to know them)."""
    for node in ast.parse(host_module.read_text(), str(host_module)).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "GUEST_TESTS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [REPO / f for f in ([value] if isinstance(value, str) else value)]
    return []


def _host_modules() -> list[Path]:
    return sorted((TESTS / "vm").glob("test_*.py"))


def _test_functions(path: Path) -> set[str]:
    return {node.name for node in ast.parse(path.read_text(), str(path)).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


_GUEST_ONLY = frozenset(f for host in _host_modules() for f in _guest_tests_of(host))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not IN_GUEST and (collection_path == GUEST_DIR or collection_path in _GUEST_ONLY):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every guest test of a collected VM group has a host test of the same name."""
    if IN_GUEST:
        return
    groups = {item.path for item in items if item.path.parent == TESTS / "vm"}
    orphans = []
    for host in sorted(groups):
        twins = _test_functions(host)
        for guest in _guest_tests_of(host):
            if not guest.exists():
                orphans.append(f"{guest.relative_to(REPO)} (named in {host.relative_to(REPO)}, missing)")
                continue
            orphans += [f"{guest.relative_to(REPO)}::{name}" for name in sorted(_test_functions(guest) - twins)]
    if orphans:
        raise pytest.UsageError("guest tests without a host twin (they would never run): " + ", ".join(orphans))


def _in_peer_group(node: pytest.Item | pytest.Collector) -> bool:
    return any(node.path.is_relative_to(g) for g in PEER_GROUPS)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    longrepr = report.longrepr
    reason = longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every test runs with its real peer: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if (IN_CI and report.skipped and not hasattr(report, "wasxfail")
            and (item.get_closest_marker("vm") is not None or _in_peer_group(item))):
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module that skips while being collected (``pytest.importorskip`` of pyverbs, say)."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and _in_peer_group(collector):
        _fail_skip(report)
