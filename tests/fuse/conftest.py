"""FUSE mount tests: real target and initiator processes, a real FUSE mount (needs root).

Without root or ``/dev/fuse`` they skip with the reason; under ``CI=true`` that skip is a failure
(``tests/conftest.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from blockd_stack import Stack  # noqa: E402


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "FUSE mount tests need root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _usable()
    if reason:
        for item in items:
            if "tests/fuse/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One target + initiator + mount shared by a test module (64 MiB, 512-byte blocks)."""
    s = Stack(tmp_path_factory.mktemp("fuse"), size=64 << 20)
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for tests that kill or restart daemons (short ctrl_loss_tmo)."""
    s = Stack(tmp_path, size=16 << 20, ctrl_loss_tmo=4)
    try:
        yield s
    finally:
        s.stop()
