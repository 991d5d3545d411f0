"""The RDMA target's compiled per-command path (target/_rdma_fast.pyx) against the Python one.

The differential test sends the same random command streams through :mod:`tests.core.rdma_sim`'s
in-process host and device to an RDMA I/O queue whose completions the compiled path takes first
and to one where everything goes to ``RdmaTargetConnection._completions`` and the Python
:class:`target.queue.TargetQueue` (the reference), and compares every work request the target
posts (receives, RDMA WRITEs with their data, RDMA READs, response SENDs with their CQEs), the
host's buffers, the backing files, the host's and the namespaces' counters, the error log, SQHD,
what is left in flight and that every registered slot came back. The streams mix what the
compiled path serves (Read with a keyed SGL, plain or invalidating) with what it must hand
over: bad NSIDs, out-of-range and overflowing LBAs, wrong transfer lengths, wrong SGL types and
FLAGS, writes (in the capsule and by RDMA READ), FUA, Flush, unknown opcodes, a namespace removed
mid-stream, a full command pool (response completions held back by the host), no free
registered slot (a small data pool), SQ flow control on and off.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("blockd.rdma.verbs", reason="the RDMA layer needs pyverbs and libibverbs", exc_type=ImportError)

import target.rdma  # noqa: E402
from blockd.rdma.abi import WC_WR_FLUSH_ERR  # noqa: E402
from blockd.dataplane import COMPILED  # noqa: E402
from protocol.constants import IoOpcode, SglId  # noqa: E402
from protocol.fabrics import CATTR_DISABLE_SQFLOW  # noqa: E402
from protocol.nvme import RW_CONTROL_FUA, build_sgl_data_block, build_sgl_keyed, build_sqe  # noqa: E402
from target.io_fast import RdmaFastPath  # noqa: E402
from target.rdma import RdmaListener  # noqa: E402
from target.target import PortInfo  # noqa: E402

from .conftest import (  # noqa: E402
    NQN, comparable_counters, config, connect_data, connect_sqe, fill_file, free_port, ns, raw_admin, run, serving, sub,
)
from .rdma_sim import Host, open_queue, patch_device  # noqa: E402
from .rdma_sim import wc as rdma_wc  # noqa: E402
from . import rdma_sim  # noqa: E402  (FakeCM.initiator_depth)

compiled_only = pytest.mark.skipif(
    RdmaFastPath is None, reason="the compiled data plane is not in use (BLOCKD_PURE=1 or not built)")

RW_SIZE = 1 << 20  # nsid 1: 512-byte blocks
RO_SIZE = 256 << 10  # nsid 2: read-only, 4096-byte blocks (3 does not exist)
RW4K_SIZE = 512 << 10  # nsid 4: 4096-byte blocks, removed mid-stream
SIZES = {1: (RW_SIZE, 512), 2: (RO_SIZE, 4096), 4: (RW4K_SIZE, 4096)}
DEPTH = 32
SMALL_POOLS = [(8192, 6), (128 << 10, 2), (1 << 20, 1)]
"""Registered data slots few enough that held-back responses run them out."""


def _command(rng: random.Random, cid: int, host: Host) -> tuple[bytes, bytes, bool]:
    """One random capsule: (SQE, in-capsule data, whether it may complete late: FUA, Flush)."""
    roll = rng.random()
    nsid = rng.choice([1] * 6 + [2] * 3 + [4] * 3 + [3, 0, 0xFFFFFFFF])
    size, block = SIZES.get(nsid, (RW_SIZE, 512))
    blocks = size // block
    most = rng.choice([2048] + [64] * 3 + [8] * 4)  # 512-byte units: up to 1 MiB, 32 KiB, 4 KiB (in a capsule)
    nlb = rng.randrange(1, max(1, most // (block // 512)) + 1)
    slba = rng.choice([rng.randrange(0, max(1, blocks - nlb + 1))] * 6
                      + [max(0, blocks - nlb + 1), blocks, (1 << 64) - 1, (1 << 64) - nlb])
    length = nlb * block
    if rng.random() < 0.08:
        length += rng.choice([-block, block, 1, -1])
    flags = 0x40 if rng.random() > 0.05 else rng.choice([0x00, 0x41, 0x80])
    control = RW_CONTROL_FUA if rng.random() < 0.1 else 0
    late = False
    data = b""
    keyed = rng.choice([SglId.KEYED_DATA_BLOCK, SglId.KEYED_DATA_BLOCK_INVALIDATE])
    if roll < 0.55:
        opcode = IoOpcode.READ
        sgl_id = keyed if rng.random() > 0.05 else rng.choice([SglId.DATA_BLOCK_OFFSET, SglId.TRANSPORT_DATA_BLOCK])
    elif roll < 0.85:
        opcode = IoOpcode.WRITE
        late = control != 0
        if rng.random() < 0.3 or length > target.rdma.RDMA_INLINE:  # data by RDMA READ
            sgl_id = keyed
        else:
            sgl_id = SglId.DATA_BLOCK_OFFSET
            data = rng.randbytes(min(target.rdma.RDMA_INLINE, max(1, length + rng.choice([0] * 6 + [-1, 7]))))
    elif roll < 0.92:
        opcode, sgl_id, length, late = IoOpcode.FLUSH, keyed, 0, True
    else:
        opcode = rng.choice([IoOpcode.WRITE_ZEROES, 0x03, 0x7E, 0xC1, 0x81])
        sgl_id, late = keyed, True
    length = max(0, length)
    if sgl_id in (SglId.KEYED_DATA_BLOCK, SglId.KEYED_DATA_BLOCK_INVALIDATE):
        addr, key = host.buffer(cid, rng.randbytes(length) if opcode == IoOpcode.WRITE else length)
        dptr = build_sgl_keyed(addr, length, key, int(sgl_id))
    else:
        dptr = build_sgl_data_block(sgl_id, 0, length)
    sqe = build_sqe(int(opcode), cid, flags=flags, nsid=nsid, dptr=dptr, cdw10=slba & 0xFFFFFFFF,
                    cdw11=slba >> 32, cdw12=(nlb - 1) | control << 16)
    return sqe, data, late


async def _answered(host: Host, want: int, hold: bool) -> None:
    """Hand the target completions until ``want`` responses came (SEND completions held back
    with ``hold``)."""
    deadline = asyncio.get_running_loop().time() + 20
    while len(host.responses) < want:
        assert not host.conn.closing, "the target closed the queue"
        assert asyncio.get_running_loop().time() < deadline, "no answer in time"
        if host.step(hold):
            continue
        if hold and host.held:
            hold = False  # a reply waits for a slot (or the pool) that only a completion frees
        else:
            await asyncio.sleep(0.001)  # a command on the executor (FUA, Flush)


async def _connected(service: Any, port: int, sqsize: int = DEPTH - 1, cattr: int = 0) -> tuple:
    """An RDMA I/O queue of ``service``'s target on the fake device, its Fabrics Connect (to the
    controller of a raw admin queue on NVMe/TCP ``port``) answered: admin, cntlid, listener,
    conn, host."""
    admin, cntlid = await raw_admin(port)
    listener = RdmaListener(service.target, PortInfo(2, "rdma", "192.0.2.1", "4420"))
    conn, host = open_queue(listener, 1, DEPTH)
    assert host.capsule(connect_sqe(qid=1, sqsize=sqsize, cattr=cattr), connect_data(cntlid=cntlid))
    await _answered(host, 1, False)
    assert host.responses[0][14:16] == b"\0\0", host.responses[0].hex()
    return admin, cntlid, listener, conn, host


def _run(tmp: Path, monkeypatch: pytest.MonkeyPatch, seed: int, count: int, cattr: int,
         sqsize: int) -> dict[str, Any]:
    tmp.mkdir()
    rw, ro, rw4k = tmp / "rw.img", tmp / "ro.img", tmp / "rw4k.img"
    fill_file(rw, RW_SIZE, seed=1)
    fill_file(ro, RO_SIZE, seed=2)
    fill_file(rw4k, RW4K_SIZE, seed=3)
    port = free_port()
    cfg = config([port], [sub(namespaces=[
        ns(rw, size=RW_SIZE), ns(ro, nsid=2, size=RO_SIZE, block_size=4096, read_only=True),
        ns(rw4k, nsid=4, size=RW4K_SIZE, block_size=4096)])])
    patch_device(monkeypatch, SMALL_POOLS)
    rng = random.Random(seed)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with serving(cfg) as service:
            admin, cntlid, listener, conn, host = await _connected(service, port, sqsize, cattr)
            ctrl = service.target.controllers[cntlid]
            sub_ = service.target.subsystems[NQN]
            cid = 0
            while cid < count:
                if cid > count // 2 and 4 in sub_.namespaces:
                    service.target.remove_namespace(sub_, 4)
                hold = rng.random() < 0.3
                sent, before = 0, len(host.responses)
                for _ in range(rng.randrange(1, 12)):
                    cid += 1
                    sqe_, data, late = _command(rng, cid, host)
                    if not host.capsule(sqe_, data):
                        break  # every receive buffer is taken: the host waits
                    sent += 1
                    if late:
                        break
                await _answered(host, before + sent, hold)
            await _answered(host, len(host.responses), False)  # what was held back
            while host.step():
                pass
            queue = ctrl.queues[1]
            fast = conn.fast
            out["served"] = fast.served if fast is not None else 0
            out["fetched"] = fast.fetched if fast is not None else 0
            out["wire"] = host.wire
            out["mem"] = host.mem
            out["in_flight"] = (queue.in_flight, [n.in_flight for n in ctrl.subsystem.namespaces.values()])
            out["counters"] = [comparable_counters(c.snapshot()) for c in
                               [ctrl.counters] + [n.counters for n in ctrl.subsystem.namespaces.values()]]
            out["error_log"] = list(ctrl.error_log)
            out["sqhd"] = queue.sqhd
            conn.close()
            await asyncio.gather(*listener.teardowns)
            out["slots"] = [p.available == p.count for p in conn.data.pools]
            await admin.close()

    run(main(), timeout=120)
    out["files"] = (rw.read_bytes(), ro.read_bytes(), rw4k.read_bytes())
    return out


def test_the_compiled_rdma_path_runs_with_the_compiled_plane() -> None:
    """The glue offers the compiled path exactly when the data plane is compiled (so the tests
    here skip only under BLOCKD_PURE=1, never because target/_rdma_fast alone failed to build)."""
    assert (RdmaFastPath is not None) == COMPILED


@compiled_only
@pytest.mark.parametrize("seed,cattr,sqsize", [
    (1, 0, DEPTH - 1), (2, CATTR_DISABLE_SQFLOW, DEPTH - 1), (3, 0, 5), (4, 0, DEPTH - 1),
    (5, CATTR_DISABLE_SQFLOW, 7), (6, 0, 3),
])
def test_compiled_path_posts_exactly_what_the_python_path_posts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                seed: int, cattr: int, sqsize: int) -> None:
    """Every work request, CQE, byte and count the same; ``sqsize`` below the queue's receive
    depth lets the host fill the command pool (a Connect's SQSIZE sets it, the CM's HSQSIZE the
    receives)."""
    fast = _run(tmp_path / "fast", monkeypatch, seed, 600, cattr, sqsize)
    monkeypatch.setattr(target.rdma, "RdmaFastPath", None)  # every completion to the Python path
    reference = _run(tmp_path / "reference", monkeypatch, seed, 600, cattr, sqsize)
    assert reference["served"] == 0
    assert fast["served"] > 60, fast["served"]  # a good part of the stream went the compiled way
    assert fast["fetched"] > 10, fast["fetched"]  # and writes by RDMA READ among them
    for i, (got, want) in enumerate(zip(fast["wire"], reference["wire"])):
        assert got == want, f"work request {i}"
    assert len(fast["wire"]) == len(reference["wire"])
    for key in ("mem", "files", "counters", "error_log", "in_flight", "sqhd", "slots"):
        assert fast[key] == reference[key], key
    assert fast["in_flight"][0] == 0 and all(fast["slots"])


@compiled_only
def test_what_the_compiled_path_leaves_to_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace whose copy is withdrawn (``accessible`` False, as ANA does), one whose backend
    was wrapped in a filter and a write to a read-only namespace are the Python path's (the
    differential test cannot tell: the Python path answers them the same); the same commands
    are served once the namespace is plain again."""
    from target.filter import BackendFilter
    rw, ro = tmp_path / "rw.img", tmp_path / "ro.img"
    fill_file(rw, RW_SIZE, seed=1)
    fill_file(ro, RO_SIZE, seed=2)
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(rw, size=RW_SIZE),
                                          ns(ro, nsid=2, size=RO_SIZE, block_size=4096, read_only=True)])])
    patch_device(monkeypatch)

    async def main() -> None:
        async with serving(cfg) as service:
            admin, cntlid, listener, conn, host = await _connected(service, port)
            namespace = service.target.subsystems[NQN].namespaces[1]

            async def command(cid: int, opcode: int, nsid: int = 1, data: bytes = b"") -> bytes:
                if opcode == IoOpcode.READ:
                    addr, key = host.buffer(cid, 4096)
                    dptr = build_sgl_keyed(addr, 4096, key, int(SglId.KEYED_DATA_BLOCK_INVALIDATE))
                else:
                    dptr = build_sgl_data_block(SglId.DATA_BLOCK_OFFSET, 0, len(data))
                assert host.capsule(build_sqe(opcode, cid, nsid=nsid, dptr=dptr, cdw12=len(data or bytes(4096)) // 512 - 1
                                              if nsid == 1 else 0), data)
                await _answered(host, len(host.responses) + 1, False)
                return host.responses[-1]

            assert (await command(1, IoOpcode.READ))[14:16] == b"\0\0" and conn.fast.served == 1
            namespace.fast.accessible = False
            assert (await command(2, IoOpcode.READ))[14:16] == b"\0\0" and conn.fast.served == 1
            namespace.fast.accessible = True
            plain = namespace.backend
            namespace.backend = BackendFilter(plain)
            assert (await command(3, IoOpcode.READ))[14:16] == b"\0\0" and conn.fast.served == 1
            namespace.backend = plain
            assert host.mem[0x10001] == host.mem[0x10002] == host.mem[0x10003] == rw.read_bytes()[:4096]
            assert (await command(4, IoOpcode.WRITE, 2, b"\1" * 4096))[14:16] != b"\0\0" and conn.fast.served == 1
            assert (await command(5, IoOpcode.WRITE, 1, b"\2" * 4096))[14:16] == b"\0\0" and conn.fast.served == 2
            assert rw.read_bytes()[:4096] == b"\2" * 4096
            conn.close()
            await asyncio.gather(*listener.teardowns)
            await admin.close()

    run(main(), timeout=60)


WRITE_SIZES = [1 << 20, 128 << 10, 8192, 256 << 10, 1 << 20, 64 << 10, 4096 + 512, 512 << 10]
"""Writes by RDMA READ of every slot class, most in several READ_CHUNK pieces, whose READs
together pass READ_BYTES_IN_FLIGHT many times over (so most wait in line for their turn)."""


def _fetched_writes(tmp: Path, monkeypatch: pytest.MonkeyPatch, end: str, pools: list | None,
                    depth: int) -> dict[str, Any]:
    """A burst of writes by RDMA READ (``WRITE_SIZES``, SGLs plain and invalidating) on small
    data pools, their READs answered batch by batch, and then ``end``: "done" (all answered),
    "bad key" (one more write whose key the host does not know: its READ fails with a remote
    access error, the queue goes), "lost" (the queue closed with READs outstanding that never
    complete) or "flushed" (closed, the outstanding READs then complete flushed); ``pools``:
    the data slot classes (None: the daemon's own); ``depth``: the initiator depth the CM
    granted (0: the host offers no RDMA READ, every write fails)."""
    tmp.mkdir()
    rw = tmp / "rw.img"
    fill_file(rw, RW_SIZE * 8, seed=4)
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(rw, size=RW_SIZE * 8)])])
    patch_device(monkeypatch, pools)
    monkeypatch.setattr(rdma_sim.FakeCM, "initiator_depth", depth)
    rng = random.Random(end)
    out: dict[str, Any] = {}

    def write(host: Host, cid: int, length: int, slba: int, key_known: bool = True) -> None:
        addr, key = host.buffer(cid, rng.randbytes(length))
        sgl = rng.choice([SglId.KEYED_DATA_BLOCK, SglId.KEYED_DATA_BLOCK_INVALIDATE])
        sqe = build_sqe(int(IoOpcode.WRITE), cid, flags=0x40, nsid=1, cdw10=slba,
                        cdw12=length // 512 - 1, dptr=build_sgl_keyed(addr, length, key if key_known else key ^ 0xFF, int(sgl)))
        assert host.capsule(sqe)

    async def main() -> None:
        async with serving(cfg) as service:
            admin, cntlid, listener, conn, host = await _connected(service, port)
            ctrl = service.target.controllers[cntlid]
            queue = ctrl.queues[1]
            namespace = service.target.subsystems[NQN].namespaces[1]
            slba = 0
            for cid, length in enumerate(WRITE_SIZES * 2, 1):
                write(host, cid, length, slba)
                slba += length // 512
            host.step(hold=True)  # the commands: the first READs go out
            if end in ("lost", "flushed"):
                host.collect()
                reads, host.pending = host.pending, []  # outstanding: never answered
                assert reads and namespace.in_flight
                conn.close()
                if end == "flushed":
                    host.pending = [rdma_wc(w[0], WC_WR_FLUSH_ERR) for w in reads]
                    host.step()
            else:
                if end == "bad key":
                    write(host, 99, 8192, slba, key_known=False)
                    while host.step():
                        pass
                    assert conn.closing
                else:
                    await _answered(host, 1 + len(WRITE_SIZES) * 2, True)
                    while host.step():  # the SEND completions held back
                        pass
                    assert all((r[14:16] == b"\0\0") == (depth > 0) for r in host.responses[1:])
            await asyncio.sleep(0)
            fast = conn.fast
            out["served"] = fast.served if fast is not None else 0
            out["fetched"] = fast.fetched if fast is not None else 0
            out["wire"] = host.wire
            out["counters"] = [comparable_counters(c.snapshot()) for c in (ctrl.counters, namespace.counters)]
            out["error_log"] = list(ctrl.error_log)
            pool = queue.in_flight  # a closed queue's answers are never sent: its count stays
            conn.close()
            await asyncio.gather(*listener.teardowns)
            out["in_flight"] = (pool if end == "done" else 0, namespace.in_flight)
            out["slots"] = [p.available == p.count for p in conn.data.pools]
            await admin.close()

    run(main(), timeout=120)
    out["file"] = rw.read_bytes()
    return out


@compiled_only
@pytest.mark.parametrize("end,pools,depth", [
    ("done", None, 16), ("done", SMALL_POOLS, 16), ("done", None, 2), ("done", None, 0), ("bad key", None, 16),
    ("lost", None, 16), ("flushed", None, 16), ("flushed", SMALL_POOLS, 16),
])
def test_writes_by_rdma_read_match_the_python_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str,
                                                   pools: list | None, depth: int) -> None:
    """The compiled path's writes by RDMA READ post the READs the Python path posts (pieces,
    bytes in flight, order behind writes waiting for a slot), write and answer the same, and
    end the same when a READ fails or the queue is lost with READs outstanding: statuses, error
    log, counters, the command pool and namespace holds, every registered slot back. With the
    small pools most writes find no free slot and wait in the Python path's line; an initiator
    depth of 2 makes the READ count, not the bytes, the bound; with none every write is the
    Python path's (Data Transfer Error)."""
    fast = _fetched_writes(tmp_path / "fast", monkeypatch, end, pools, depth)
    monkeypatch.setattr(target.rdma, "RdmaFastPath", None)
    reference = _fetched_writes(tmp_path / "reference", monkeypatch, end, pools, depth)
    assert reference["fetched"] == 0
    if pools is None and depth:  # every write was the compiled path's
        assert fast["served"] == 2 * len(WRITE_SIZES) + (end == "bad key"), fast["served"]
    if end == "done" and depth:
        assert fast["fetched"] >= (2 * len(WRITE_SIZES) if pools is None else 3), fast["fetched"]
    reads = [w for w in fast["wire"] if w[0] == "read"]
    assert bool(reads and max(w[5] for w in reads) == target.rdma.READ_CHUNK) == (depth > 0)
    for i, (got, want) in enumerate(zip(fast["wire"], reference["wire"])):
        assert got == want, f"work request {i}"
    assert len(fast["wire"]) == len(reference["wire"])
    for key in ("file", "counters", "error_log", "in_flight", "slots"):
        assert fast[key] == reference[key], key
    assert all(fast["slots"]) and fast["in_flight"] == (0, 0)
