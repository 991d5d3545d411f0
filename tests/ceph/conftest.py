"""The Ceph group's session cluster (:mod:`tests.ceph.cluster`): one per test session, each test
on images of its own.

Where Ceph's programs or python3-rbd are missing the group skips with the reason; under
``CI=true`` that skip is a failure (``tests/conftest.py``, as for the VM bed), and a cluster
that cannot start fails the run wherever it happens."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.ceph.cluster import Cluster, missing_programs

_images = itertools.count(1)


@pytest.fixture(scope="session")
def ceph() -> Iterator[Cluster]:
    missing = missing_programs()
    try:
        import rbd  # noqa: F401  (python3-rbd: Debian's, through --system-site-packages)
    except ImportError:
        missing.append("python3-rbd")
    if missing:
        pytest.skip(f"no single-node Ceph here: {', '.join(missing)} missing (scripts/setup.sh installs them)")
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="blockd-ceph-")))
    try:
        cluster.start()
    except Exception as exc:
        pytest.fail(f"the single-node Ceph cluster could not start: {exc}", pytrace=False)
    print(f"\nceph cluster up in {cluster.start_seconds:.2f} s, RSS KiB {cluster.rss_kib()}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def image(ceph: Cluster) -> str:
    """A new 64 MiB image of the session cluster's pool; its name."""
    name = f"img{next(_images)}"
    ceph.create_image(name, 64 << 20)
    return name


def rbd_ns(cluster: Cluster, image: str, nsid: int = 1, **options: object) -> dict[str, object]:
    """A namespace table with ``backend = "rbd"`` on ``image``."""
    return {"nsid": nsid, "backend": "rbd", "path": f"{cluster.pool}/{image}",
            "options": {"conf": str(cluster.conf), **options}}
