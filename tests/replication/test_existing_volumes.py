"""Replicating a volume that already holds data: ``blockctl target create-md`` with the metadata
at the end of the volume (internal) or in a file of its own (external, ``metadata_path``), and
the error that sends an operator there.

The end-to-end tests run real daemons on loopback (tests/replication/nodes.py): the primary's
file is filled before replication is switched on, ``create-md`` formats its metadata, and the
data area must come through unchanged on the primary (hash) and equal on the replica after its
full sync."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from protocol.replication import METADATA_BLOCK, MetadataError, layout
from target.backend import FileBackend
from target.replication.blockio import BackendBlockIO
from target.replication.external import ExternalMetadata, external_layout
from target.replication.fs_probe import (
    EXT_INCOMPAT_64BIT, EXT_MAGIC, EXT_SUPERBLOCK_OFFSET, PROBE_LENGTH, ExtSuperblock, FileSystem, file_system)
from target.replication.metadata import Metadata, create
from target.config import load
from target.service import _open_namespace

from .nodes import BIN, NQN, REGION, Node, all_in_sync

DEVICE = 8 << 20


def sha(path: Path, length: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(length)).hexdigest()


@pytest.mark.parametrize("data_size", [REGION, 1 << 20, (8 << 20) + 4096, 1 << 30, 3 << 40, (1 << 40) - 4096])
@pytest.mark.parametrize("region_size,max_peers", [(4096, 1), (REGION, 4), (1 << 20, 32)])
def test_external_layout_keeps_the_whole_data_area(data_size: int, region_size: int, max_peers: int) -> None:
    if data_size < region_size:  # as with internal metadata: at least one region
        with pytest.raises(MetadataError, match="too small"):
            external_layout(data_size, region_size, max_peers)
        return
    lay = external_layout(data_size, region_size, max_peers)
    assert lay.data_size == data_size
    assert lay.device_size == data_size + lay.metadata_length
    assert layout(lay.device_size, region_size, max_peers) == lay  # what Metadata.open finds on the combined device
    # the smallest such area: one bitmap block less per slot leaves too little room for the bits
    assert lay.bitmap_length * 8 >= -(-lay.device_size // region_size)
    assert (lay.bitmap_length - METADATA_BLOCK) * 8 < -(-(lay.device_size - max_peers * METADATA_BLOCK) // region_size)


def test_create_refuses_an_area_that_is_not_blank_and_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "vol.img"
    data = os.urandom(DEVICE)
    path.write_bytes(data)  # a volume written to its last byte: the metadata area holds data
    lay = layout(DEVICE, REGION, 4)

    async def run() -> None:
        backend = FileBackend(str(path))
        io = BackendBlockIO(backend)
        try:
            with pytest.raises(MetadataError, match=f"byte {lay.data_size} is not zero.*--force"):
                await create(io, REGION, 4)
            assert path.read_bytes() == data  # nothing written
            md = await create(io, REGION, 4, force=True)
            assert md.data_size == lay.data_size and md.current != 0
            with pytest.raises(MetadataError, match="holds replication metadata already"):
                await create(io, REGION, 4)
        finally:
            backend.close()
    asyncio.run(run())
    assert path.read_bytes()[:lay.data_size] == data[:lay.data_size]


def test_a_volume_with_data_but_no_metadata_names_create_md(tmp_path: Path) -> None:
    """The start-up error an operator sees: where (subsystem and namespace, once), what, and the
    command to run."""
    primary, replica = Node(tmp_path, "primary", DEVICE), Node(tmp_path, "r1", DEVICE)
    primary.file.write_bytes(os.urandom(DEVICE))
    primary.cfg.write_text(primary.config(NQN, [replica]))
    [nc] = load(str(primary.cfg)).subsystems[0].namespaces

    async def unreachable(*_: object) -> None:
        raise AssertionError("the replica is not contacted before the metadata reads")

    async def run() -> str:
        with pytest.raises(RuntimeError) as err:
            await _open_namespace(SimpleNamespace(nqn=NQN), nc, unreachable, primary=True)
        return str(err.value)
    text = asyncio.run(run())
    assert text.startswith(f"{NQN} namespace 1: replication metadata unreadable: no usable replication superblock")
    assert text.count("namespace 1") == 1, text
    assert "blockctl target create-md --config FILE NQN NSID" in text


def test_external_metadata_reads_and_writes_both_parts(tmp_path: Path) -> None:
    data_path, meta_path = tmp_path / "vol.img", tmp_path / "vol.md"
    data_path.write_bytes(os.urandom(DEVICE))
    before = data_path.read_bytes()

    async def run() -> None:
        copy = ExternalMetadata.open(FileBackend(str(data_path)), str(meta_path), REGION, 4, create=True)
        try:
            lay = external_layout(DEVICE, REGION, 4)
            assert copy.size == lay.device_size and meta_path.stat().st_size == lay.metadata_length
            md = await Metadata.format(BackendBlockIO(copy), REGION, 4)
            assert md.data_size == DEVICE
            span = os.urandom(3 * METADATA_BLOCK)  # one write across the boundary lands in both files
            await copy.write(DEVICE - METADATA_BLOCK, span)
            buf = bytearray(len(span))
            await copy.read_into(DEVICE - METADATA_BLOCK, memoryview(buf))
            assert buf == span
        finally:
            copy.close()
        assert data_path.read_bytes()[-METADATA_BLOCK:] == span[:METADATA_BLOCK]
        assert meta_path.read_bytes()[:2 * METADATA_BLOCK] == span[METADATA_BLOCK:]
        with pytest.raises(ValueError, match="does not exist.*create-md"):
            ExternalMetadata.open(FileBackend(str(data_path)), str(tmp_path / "none.md"), REGION, 4)
    asyncio.run(run())
    assert data_path.read_bytes()[:-METADATA_BLOCK] == before[:-METADATA_BLOCK]


def create_md(node: Node, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "blockctl"), "target", "create-md", "--config", str(node.cfg), NQN, "1", *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("external", [False, True], ids=["internal", "external"])
def test_create_md_on_a_volume_with_data_then_a_full_sync(tmp_path: Path, external: bool) -> None:
    primary = Node(tmp_path, "primary", DEVICE)
    keys = f'metadata_path = "{tmp_path / "primary.md"}"\n' if external else ""
    data_size = DEVICE if external else layout(DEVICE, REGION, 4).data_size
    device = external_layout(DEVICE, REGION, 4).device_size if external else DEVICE
    replica = Node(tmp_path, "r1", device)
    content = os.urandom(data_size)  # written before replication (internal: a volume shrunk to its data area)
    tail = bytes(DEVICE - data_size)
    primary.cfg.write_text(primary.config(NQN, [replica], ns_keys=keys))
    if not external:  # something in the metadata area: refused, nothing written
        primary.file.write_bytes(content + b"\x01" * len(tail))
        refused = create_md(primary)
        assert refused.returncode != 0 and "is not blank" in refused.stderr and "--force" in refused.stderr
        assert sha(primary.file, DEVICE) == hashlib.sha256(content + b"\x01" * len(tail)).hexdigest()
    primary.file.write_bytes(content + tail)
    made = create_md(primary, "--json")
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    assert (info["data_size"], info["device_size"], info["shrink"]) == (data_size, device, DEVICE - data_size)
    again = create_md(primary)
    assert again.returncode != 0 and "holds replication metadata already" in again.stderr
    try:
        replica.start()
        primary.start([replica], ns_keys=keys)
        primary.wait_states(all_in_sync(settled=True), timeout=60)
        listed = primary.ctl("replicas", "--json")
        assert json.loads(listed.stdout)["namespaces"][0]["data_size"] == data_size
    finally:
        primary.stop()
        replica.stop()
    want = hashlib.sha256(content).hexdigest()
    assert sha(primary.file, data_size) == want  # the data the volume held, unchanged
    assert sha(replica.file, data_size) == want  # and the replica's full sync equal
    assert primary.file.stat().st_size == DEVICE


def test_create_md_text_says_what_the_data_area_becomes(tmp_path: Path) -> None:
    node = Node(tmp_path, "primary", DEVICE)
    node.cfg.write_text(node.config(NQN, [Node(tmp_path, "r1")]))
    made = create_md(node)
    data_size = layout(DEVICE, REGION, 4).data_size
    assert made.returncode == 0, made.stderr
    assert f"the data area shrinks by {DEVICE - data_size} bytes" in made.stdout
    assert f"exports {data_size} bytes" in made.stdout and f"must have {DEVICE} bytes" in made.stdout
    ext = Node(tmp_path, "ext", DEVICE)
    ext.file.write_bytes(os.urandom(DEVICE))
    ext.cfg.write_text(ext.config(NQN, [node], ns_keys=f'metadata_path = "{tmp_path / "ext.md"}"\n'))
    made = create_md(ext)
    assert made.returncode == 0, made.stderr
    assert f"the data area is all of {ext.file}, unchanged" in made.stdout and f"exports {DEVICE} bytes" in made.stdout


def _fs_volume(path: Path, size: int, mkfs: list[str]) -> None:
    """A sparse volume of ``size`` bytes with a file system made by ``mkfs`` (its last argument
    the volume's path)."""
    with open(path, "wb") as f:
        f.truncate(size)
    subprocess.run([*mkfs, str(path)], check=True, capture_output=True)


def _create(path: Path, force: bool = False) -> Metadata:
    async def run() -> Metadata:
        backend = FileBackend(str(path))
        try:
            return await create(BackendBlockIO(backend), REGION, 4, force=force)
        finally:
            backend.close()
    return asyncio.run(run())


def test_create_refuses_internal_metadata_over_an_ext4_that_spans_the_volume(tmp_path: Path) -> None:
    """mkfs.ext4 writes nothing in its last blocks, so the metadata area reads as zeroes; the
    superblock's block count says the file system reaches there. The message's resize2fs
    command, run as printed, makes room, and the file system stays clean."""
    path = tmp_path / "vol.img"
    _fs_volume(path, 64 << 20, ["mkfs.ext4", "-q", "-F", "-O", "64bit"])
    data_size = layout(64 << 20, REGION, 4).data_size
    before = path.read_bytes()
    with pytest.raises(MetadataError, match=rf"ext2/3/4 file system on the volume ends at byte {64 << 20}, past the "
                       rf"data area's end at byte {data_size} .*resize2fs DEVICE {data_size // 1024}K.*nothing was written"):
        _create(path)
    assert path.read_bytes() == before
    subprocess.run(["e2fsck", "-f", "-y", str(path)], check=True, capture_output=True)  # resize2fs asks for it
    subprocess.run(["resize2fs", str(path), f"{data_size // 1024}K"], check=True, capture_output=True)
    os.truncate(path, 64 << 20)  # resize2fs cuts an image file to the new size; a device (or a namespace's file) keeps its own
    assert _create(path).data_size == data_size
    subprocess.run(["e2fsck", "-f", "-n", str(path)], check=True, capture_output=True)


def test_create_refuses_internal_metadata_over_an_xfs_that_spans_the_volume(tmp_path: Path) -> None:
    """XFS cannot shrink: the message sends the operator to external metadata; an XFS made
    for the data area alone is accepted."""
    size = 512 << 20  # mkfs.xfs's smallest data section is 300 MiB
    data_size = layout(size, REGION, 4).data_size
    whole, fitted = tmp_path / "whole.img", tmp_path / "fitted.img"
    _fs_volume(whole, size, ["mkfs.xfs", "-q", "-f"])
    with pytest.raises(MetadataError, match=rf"xfs file system on the volume ends at byte {size}, .*xfs cannot "
                       r"shrink: keep the whole volume with external metadata"):
        _create(whole)
    assert _create(whole, force=True).data_size == data_size  # the operator's word overrides, as for a non-blank area
    _fs_volume(fitted, size, ["mkfs.xfs", "-q", "-f", "-d", f"size={data_size}"])
    assert _create(fitted).data_size == data_size


def test_the_probe_reads_a_64bit_ext4_block_count_and_ignores_other_bytes() -> None:
    """The upper 32 bits of the block count count only with the 64bit feature (mkfs makes no
    file system big enough to set them in a test); random bytes are no file system."""
    head = bytearray(PROBE_LENGTH)
    assert file_system(bytes(head)) is None
    head[EXT_SUPERBLOCK_OFFSET:] = ExtSuperblock.build(dict(
        blocks_count_lo=5, log_block_size=2, magic=EXT_MAGIC, feature_incompat=EXT_INCOMPAT_64BIT, blocks_count_hi=3))
    assert file_system(bytes(head)) == FileSystem("ext2/3/4", ((3 << 32) | 5) * 4096, "resize2fs")
    head[EXT_SUPERBLOCK_OFFSET + 0x60] = 0  # the 64bit feature off: the high word is not part of the count
    assert file_system(bytes(head)) == FileSystem("ext2/3/4", 5 * 4096, "resize2fs")
