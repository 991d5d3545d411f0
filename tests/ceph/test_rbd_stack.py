"""The daemons and the CLI over an RBD namespace: ``blockctl write``/``read`` byte-exact (and the
bytes in the image), fio's verify through the FUSE mount."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

rados = pytest.importorskip("rados", reason="python3-rados is missing (scripts/setup.sh installs it)")
rbd = pytest.importorskip("rbd", reason="python3-rbd is missing (scripts/setup.sh installs it)")

from tests.ceph.cluster import Cluster
from tests.ceph.rbd_stack import RbdStack

SIZE = 64 << 20


@pytest.fixture
def rbd_stack(ceph: Cluster, image: str, tmp_path: Path) -> Iterator[RbdStack]:
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("the FUSE mount needs root and /dev/fuse")
    stack = RbdStack(tmp_path, ceph, image, SIZE)
    try:
        yield stack.start()
    finally:
        stack.stop()


def _image_bytes(cluster: Cluster, image: str, offset: int, length: int) -> bytes:
    r = rados.Rados(conffile=str(cluster.conf))
    r.connect()
    try:
        io = r.open_ioctx(cluster.pool)
        with rbd.Image(io, image, read_only=True) as img:
            return img.read(offset, length)
    finally:
        r.shutdown()


def test_blockctl_write_read_byte_exact(rbd_stack: RbdStack, ceph: Cluster, tmp_path: Path) -> None:
    pattern = random.Random(37).randbytes(3 << 20)
    src = tmp_path / "pattern.bin"
    src.write_bytes(pattern)
    assert f"nsid 1: {SIZE} bytes" in rbd_stack.blockctl("list").stdout
    rbd_stack.blockctl("write", "vol", "--nsid", "1", "--offset", "1048576", "-i", str(src))
    out = tmp_path / "back.bin"
    rbd_stack.blockctl("read", "vol", "--offset", "1048576", "--length", str(len(pattern)), "-o", str(out))
    assert out.read_bytes() == pattern
    assert _image_bytes(ceph, rbd_stack.image, 1 << 20, len(pattern)) == pattern


def test_fio_verify_through_the_mount(rbd_stack: RbdStack) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    proc = subprocess.run(["fio", "--name=verify", f"--filename={rbd_stack.file}", "--direct=1",
                           "--ioengine=libaio", "--iodepth=16", "--rw=randwrite", "--bs=4k",
                           "--offset=8M", "--size=16M", "--verify=crc32c", "--verify_fatal=1",
                           "--do_verify=1", "--verify_state_save=0", "--output-format=json"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    job = json.loads(proc.stdout)["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] == 16 << 20 and job["read"]["io_bytes"] == 16 << 20


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_ext4_made_through_the_mount_is_clean_in_the_image(rbd_stack: RbdStack, ceph: Cluster, tmp_path: Path) -> None:
    """mkfs.ext4 with a copied tree (``-d``) through the FUSE mount: the image exported from the
    cluster (``rbd export``) passes e2fsck and gives back every file, sha256 for sha256."""
    src = tmp_path / "tree"
    shutil.copytree(Path(__file__).resolve().parents[2] / "protocol", src,
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(src), str(rbd_stack.file)],
                   check=True, capture_output=True, timeout=120)
    exported = tmp_path / "export.img"
    ceph.run("rbd", "export", f"{ceph.pool}/{rbd_stack.image}", str(exported))
    fsck = subprocess.run(["e2fsck", "-fn", str(exported)], capture_output=True, text=True, timeout=60)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["debugfs", "-R", f"rdump / {out}", str(exported)], check=True, capture_output=True, timeout=60)
    got = _tree_digest(out)
    got.pop("lost+found", None)
    assert got == _tree_digest(src) and len(got) > 10
