"""The ``rbd`` backend on the session's single-node cluster, with blockd's host in this process:
bytes land in the image, Identify matches a file namespace but for the ids (derived from the
image), an outside ``rbd resize`` reaches the host as an event, and a blocklisted gateway answers
with a path status the host retries elsewhere."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

rados = pytest.importorskip("rados", reason="python3-rados is missing (scripts/setup.sh installs it)")
rbd = pytest.importorskip("rbd", reason="python3-rbd is missing (scripts/setup.sh installs it)")

from initiator.errors import NvmeError  # noqa: E402  (after the importorskip of python3-rbd)
from protocol.reservation import PTPL, RESCAP_ALL
from protocol.status import Status
from target.config import NamespaceConfig
from target.rbd_backend import RbdOptions
from tests.ceph.cluster import WATCH_TIMEOUT, Cluster
from tests.ceph.conftest import rbd_ns
from tests.core.conftest import NQN, config, connect, free_port, ns, run, serving, sub, until

MIB = 1 << 20


class Client:
    """A second RADOS client on the image (an administrator, another gateway)."""

    def __init__(self, cluster: Cluster, image: str) -> None:
        self.rados = rados.Rados(conffile=str(cluster.conf))
        self.rados.conf_set("rbd_cache", "false")
        self.rados.connect()
        self.ioctx = self.rados.open_ioctx(cluster.pool)
        self.image = rbd.Image(self.ioctx, image)

    def close(self) -> None:
        self.image.close()
        self.ioctx.close()
        self.rados.shutdown()


def test_bytes_land_in_the_image(ceph: Cluster, image: str) -> None:
    port = free_port()
    rng = random.Random(37)
    data = rng.randbytes(256 * 1024)
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image)])])

    async def main() -> tuple[bytes, bytes, bytes]:
        async with serving(cfg) as service:
            backend = service.target.subsystems[NQN].namespaces[1].backend
            assert type(backend).__name__ == "RbdBackend" and service.target.subsystems[NQN].namespaces[1].fast is None
            host = await connect(port, nr_io_queues=2)
            try:
                assert host.namespaces[1].size == 64 * MIB  # the image's size
                await host.write_bytes(1, 3 * MIB + 4096, data)
                await host.write_bytes(1, 10 * MIB, b"f" * 4096, fua=True)
                back = bytes(await host.read_bytes(1, 3 * MIB + 4096, len(data)))
                await host.write_bytes(1, 20 * MIB, b"z" * 8192)
                await host.deallocate(1, [(20 * MIB // 512 + 1, 3)])  # 1.5 KiB, not object-aligned
                await host.write_zeroes(1, 20 * MIB // 512 + 10, 2)
                holes = bytes(await host.read_bytes(1, 20 * MIB, 8192))
                return back, holes, bytes(await host.read_bytes(1, 10 * MIB, 4096))
            finally:
                await host.close()

    back, holes, fua = run(main())
    assert back == data and fua == b"f" * 4096
    assert holes == b"z" * 512 + bytes(1536) + b"z" * 3072 + bytes(1024) + b"z" * 2048
    other = Client(ceph, image)  # what a second client reads from the cluster itself
    try:
        assert other.image.read(3 * MIB + 4096, len(data)) == data
        assert other.image.read(20 * MIB, 8192) == holes
    finally:
        other.close()


def _idns(ident: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(ident).items() if not k.startswith("_") and k not in ("nguid", "eui64")}


def test_identify_matches_a_file_namespace_but_the_ids(ceph: Cluster, image: str, tmp_path: Path) -> None:
    port = free_port()
    other_nqn = NQN + "-other"
    cfg = config([port], [sub(NQN, [ns(tmp_path / "f.img", 1, size=64 * MIB), rbd_ns(ceph, image, nsid=2)]),
                          sub(other_nqn, [rbd_ns(ceph, image, nsid=7)])])

    async def main() -> tuple[Any, ...]:
        async with serving(cfg) as service:
            host = await connect(port, nr_io_queues=1)
            other = await connect(port, other_nqn, nr_io_queues=1)
            try:
                ns1 = service.target.subsystems[NQN].namespaces
                ids = (ns1[1].nguid, ns1[2].nguid, ns1[2].uuid,
                       service.target.subsystems[other_nqn].namespaces[7].nguid)
                return (await host.identify_namespace(1), await host.identify_namespace(2),
                        await other.identify_namespace(7), ids,
                        service.target.subsystems[NQN].namespaces[2].backend.derived_ids())
            finally:
                await host.close()
                await other.close()

    file_id, rbd_id, other_id, (file_nguid, rbd_nguid, rbd_uuid, other_nguid), derived = run(main())
    # RESCAP bit 0 (PTPL) is the one capability that differs: PTPL keeps the reservation state in
    # a sidecar file beside the namespace's file (docs/operations.md), and an image has none
    assert _idns(rbd_id) | {"rescap": 0} == _idns(file_id) | {"rescap": 0}
    assert (file_id.rescap, rbd_id.rescap) == (RESCAP_ALL, RESCAP_ALL & ~PTPL)
    assert bytes(rbd_id.nguid) == rbd_nguid == derived[0] != file_nguid
    assert rbd_uuid.bytes == derived[1]
    assert other_nguid == rbd_nguid and bytes(other_id.nguid) == rbd_nguid  # another NQN, nsid: same ids


def test_outside_resize_reaches_the_host(ceph: Cluster, image: str) -> None:
    port = free_port()
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image)])])

    async def main() -> list[int]:
        async with serving(cfg):
            host = await connect(port, nr_io_queues=1)
            seen: list[int] = []
            host.namespace_listeners.append(lambda: seen.append(host.namespaces[1].size))
            try:
                ceph.run("rbd", "resize", f"{ceph.pool}/{image}", "--size", "96M")
                await until(lambda: host.namespaces[1].size == 96 * MIB, timeout=15)
                assert (await host.identify_namespace(1)).nsze == 96 * MIB // 512
                await host.write_bytes(1, 90 * MIB, b"g" * 4096)  # past the old end
                assert await host.read_bytes(1, 90 * MIB, 4096) == b"g" * 4096
                return seen
            finally:
                await host.close()

    assert run(main()) == [96 * MIB]


def test_a_blocklisted_gateway_answers_with_a_path_status(ceph: Cluster, image: str) -> None:
    port = free_port()
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image)])])

    async def main() -> tuple[int, int, bool]:
        async with serving(cfg) as service:
            host = await connect(port, nr_io_queues=1)
            other = Client(ceph, image)
            try:
                await host.write_bytes(1, 0, b"a" * 4096)  # librbd takes the exclusive lock for it
                owner = next(iter(other.image.lock_get_owners()))
                other.image.lock_break(owner["mode"], owner["owner"])  # blocklists the target's client
                with pytest.raises(NvmeError) as wrote:
                    await host.write_bytes(1, 0, b"b" * 4096)
                with pytest.raises(NvmeError) as read:
                    await host.read_bytes(1, 0, 4096)
                assert other.image.read(0, 4096) == b"a" * 4096  # the refused write did not land
                return wrote.value.status, read.value.status, service.target.subsystems[NQN].namespaces[1].backend.fenced
            finally:
                other.close()
                await host.close()

    wrote, read, fenced = run(main())
    assert wrote == read == Status.ANA_INACCESSIBLE and fenced


OP_TIMEOUT = 2
SLACK = 6.0
"""Seconds past the op timeout a host command may take to come back (loop hops, librados'
timer tick, a loaded machine)."""


def _state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat: R, S, T for stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_gateway_cut_from_the_cluster_answers_with_a_path_status_in_bounded_time(ceph: Cluster, image: str) -> None:
    """The OSD stopped (SIGSTOP: the cluster unreachable, the host's link fine): a write and a read
    each come back within the op timeout + slack with ANA Inaccessible, not a media error, and
    the target lives on; the OSD resumed, I/O works again."""
    port = free_port()
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image, op_timeout=OP_TIMEOUT)])])
    osd = ceph.procs["osd"].pid

    async def timed(op: Any) -> tuple[int, float]:
        t0 = time.monotonic()
        with pytest.raises(NvmeError) as failed:
            await asyncio.wait_for(op, OP_TIMEOUT + SLACK)  # without the timeout it would hang
        return failed.value.status, time.monotonic() - t0

    async def main() -> tuple[list[tuple[int, float]], bytes]:
        async with serving(cfg):
            host = await connect(port, nr_io_queues=1)
            try:
                await host.write_bytes(1, 0, b"a" * 4096)  # librbd takes the exclusive lock for it
                os.kill(osd, signal.SIGSTOP)
                try:
                    await until(lambda: _state(osd) == "T", timeout=5)  # every thread of it stopped
                    cut = [await timed(host.write_bytes(1, 4096, b"b" * 4096)),
                           await timed(host.read_bytes(1, 0, 4096))]
                finally:
                    os.kill(osd, signal.SIGCONT)
                await host.write_bytes(1, 8192, b"c" * 4096)
                return cut, bytes(await host.read_bytes(1, 0, 12288))
            finally:
                await host.close()

    cut, back = run(main())
    assert [status for status, _ in cut] == [Status.ANA_INACCESSIBLE] * 2, cut
    assert all(OP_TIMEOUT * 0.9 < took < OP_TIMEOUT + SLACK for _, took in cut), cut
    assert back[:4096] == b"a" * 4096 and back[8192:] == b"c" * 4096


def test_a_resize_after_the_header_watch_broke_still_reaches_the_host(ceph: Cluster, image: str) -> None:
    """The OSD paused for longer than the watch timeout drops the target's watch on the image
    header (librbd watches its own header again, not ours): the target watches it again, so a
    later ``rbd resize`` still reaches the host."""
    port = free_port()
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image)])])
    osd = ceph.procs["osd"].pid

    async def main() -> None:
        async with serving(cfg):
            host = await connect(port, nr_io_queues=1)
            try:
                os.kill(osd, signal.SIGSTOP)
                try:
                    await asyncio.sleep(WATCH_TIMEOUT + 2)
                finally:
                    os.kill(osd, signal.SIGCONT)
                await asyncio.sleep(WATCH_TIMEOUT + 2)  # the OSD times the watch out and the client hears of it
                ceph.run("rbd", "resize", f"{ceph.pool}/{image}", "--size", "96M")
                await until(lambda: host.namespaces[1].size == 96 * MIB, timeout=20)
            finally:
                await host.close()

    run(main())


@pytest.mark.parametrize("path, options, error", [
    ("rbd", {}, "pool/image"),
    ("rbd/a/b", {}, "pool/image"),
    ("rbd/x", {"cache": True}, "unknown rbd option 'cache'"),
    ("rbd/x", {"failover": "yes"}, "failover has the wrong type"),
    ("rbd/x", {"op_timeout": 2.5}, "op_timeout has the wrong type"),
    ("rbd/x", {"op_timeout": -1}, "op_timeout must be >= 0"),
])
def test_bad_options_get_one_line(path: str, options: dict[str, Any], error: str) -> None:
    nc = NamespaceConfig(1, path, None, backend="rbd", options=tuple(sorted(options.items())))
    with pytest.raises(ValueError, match=error):
        RbdOptions.from_config(nc)


def test_a_missing_image_fails_the_start_with_its_name(ceph: Cluster) -> None:
    cfg = config([free_port()], [sub(NQN, [rbd_ns(ceph, "no-such-image")])])

    async def main() -> None:
        async with serving(cfg):
            pass
    with pytest.raises(RuntimeError, match="cannot open rbd/no-such-image: .*image not found"):
        run(main())
    assert os.path.exists(ceph.conf)


def test_the_resize_verb_resizes_the_image(ceph: Cluster, image: str) -> None:
    """``blockctl target resize`` with a size grows the image itself (another client sees it)
    and the host gets the event."""
    port = free_port()
    cfg = config([port], [sub(NQN, [rbd_ns(ceph, image)])])

    async def main() -> tuple[list[int], dict[str, Any]]:
        async with serving(cfg) as service:
            host = await connect(port, nr_io_queues=1)
            seen: list[int] = []
            host.namespace_listeners.append(lambda: seen.append(host.namespaces[1].size))
            try:
                reply = await service.op_resize(NQN, 1, 80 * MIB)
                await until(lambda: host.namespaces[1].size == 80 * MIB, timeout=15)
                other = Client(ceph, image)
                try:
                    assert other.image.size() == 80 * MIB
                finally:
                    other.close()
                return seen, reply
            finally:
                await host.close()

    seen, reply = run(main())
    assert (reply["old_size"], reply["size"]) == (64 * MIB, 80 * MIB)
    assert seen[0] == 80 * MIB


def test_failover_needs_the_exclusive_lock_feature(ceph: Cluster) -> None:
    ceph.run("rbd", "create", f"{ceph.pool}/nolock", "--size", "8M", "--image-feature", "layering")
    cfg = config([free_port()], [sub(NQN, [rbd_ns(ceph, "nolock", failover=True)])])

    async def main() -> None:
        async with serving(cfg):
            pass
    with pytest.raises(RuntimeError, match="failover needs the exclusive-lock feature"):
        run(main())
