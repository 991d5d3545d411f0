"""The host library against the target, over real sockets on 127.0.0.1 and real files."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest

from initiator.controller import ConnectError, Controller
from initiator.discovery import discover
from initiator.errors import NvmeError, QueueLost
from protocol.commands import identify_command, read_command
from protocol.constants import DISCOVERY_NQN, Cns
from protocol.identify import ACTIVE_NS_LIST
from protocol.logpage import DISCOVERY_HEADER
from protocol.status import Status
from target.service import TargetService
from target.tcp import TCP_IO_INLINE

from .conftest import (
    HOSTNQN, NQN, NQN2, RawConn, config, connect, fill_file, free_port, ns, run, serving, sub, until,
)

SIZE = 8 << 20


async def identify(ctrl: Controller, cns: int, nsid: int = 0) -> bytes:
    buf = bytearray(4096)
    await ctrl.admin_command(identify_command(cns, nsid), data_in=memoryview(buf))
    return bytes(buf)


def ns_descriptors(raw: bytes) -> dict[int, bytes]:
    out, pos = {}, 0
    while raw[pos + 1]:
        nidt, nidl = raw[pos], raw[pos + 1]
        out[nidt] = raw[pos + 4:pos + 4 + nidl]
        pos += 4 + nidl
    return out


def test_connect_identify_and_namespaces(tmp_path: Path) -> None:
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1), ns(tmp_path / "b.img", 3, block_size=4096)])])

    async def main() -> tuple[bytes, bytes]:
        async with serving(cfg) as service:
            ctrl = await connect(port, nr_io_queues=3)
            try:
                assert len(ctrl.io) == 3
                tctrl = service.target.controllers[ctrl.cntlid]
                assert sorted(tctrl.queues) == [0, 1, 2, 3]
                ident = await ctrl.identify_controller()
                assert ident.cntlid == ctrl.cntlid
                assert ident.subnqn == NQN
                assert ident.sn.strip() == "BLOCKDTEST0001" and ident.mn.strip() == "blockd test"
                assert ident.kas > 0
                assert ident.ioccsz == (64 + TCP_IO_INLINE) // 16
                assert ident.icdoff == 0
                assert ident.sgls & 3
                assert ident.cntrltype == 1 and ident.nn == 3 and ident.maxcmd >= 32
                assert ident.oncs & 0xC == 0xC and ident.vwc & 1

                n1 = await ctrl.identify_namespace(1)
                assert n1.nsze == SIZE // 512 and n1.lbaf[n1.flbas & 0xF].lbads == 9
                n3 = await ctrl.identify_namespace(3)
                assert n3.nsze == SIZE // 4096 and n3.lbaf[n3.flbas & 0xF].lbads == 12
                assert ctrl.namespaces[3].block_size == 4096

                ids = list(ACTIVE_NS_LIST.parse(await identify(ctrl, Cns.ACTIVE_NS_LIST, 0)))
                assert ids[:3] == [1, 3, 0]
                ids = list(ACTIVE_NS_LIST.parse(await identify(ctrl, Cns.ACTIVE_NS_LIST, 1)))
                assert ids[:2] == [3, 0]

                d1 = await identify(ctrl, Cns.NS_DESCRIPTORS, 1)
                d3 = await identify(ctrl, Cns.NS_DESCRIPTORS, 3)
                assert ns_descriptors(d1)[2] == n1.nguid and len(ns_descriptors(d1)[3]) == 16
                assert ns_descriptors(d1) != ns_descriptors(d3)
                with pytest.raises(NvmeError) as err:
                    await identify(ctrl, Cns.NAMESPACE, 2)
                assert err.value.status == Status.INVALID_NS
                return d1, d3
            finally:
                await ctrl.close()

    first = run(main())
    second = run(main())  # a restarted target: identifiers are stable
    assert first == second


def test_io_many_in_flight_on_several_queues(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "vol.img"
    original = fill_file(path, SIZE)
    cfg = config([port], [sub(namespaces=[ns(path, 1, size=SIZE)])])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port, nr_io_queues=4, queue_size=32)
            try:
                rng = random.Random(1)
                # 256 single-block writes in flight at once, spread over 4 queues of depth 32.
                blocks = {lba: rng.randbytes(512) for lba in rng.sample(range(SIZE // 512 // 2), 256)}
                await asyncio.gather(*(ctrl.write(1, lba, data) for lba, data in blocks.items()))
                # 1 MiB takes the R2T/H2CData path (beyond the 128 KiB in-capsule limit), 128 KiB goes in-capsule.
                big = rng.randbytes(1 << 20)
                medium = rng.randbytes(128 << 10)
                await asyncio.gather(ctrl.write(1, 8192, big), ctrl.write(1, 12288, medium, fua=True))
                reads = await asyncio.gather(*(ctrl.read(1, lba, 1) for lba in blocks))
                assert [bytes(r) for r in reads] == list(blocks.values())
                assert await ctrl.read(1, 8192, len(big) // 512) == big
                assert await ctrl.read_bytes(1, 12288 * 512, len(medium)) == medium
                await ctrl.flush(1)
                await ctrl.flush(0xFFFFFFFF)
            finally:
                await ctrl.close()
        expected = bytearray(original)
        for lba, data in blocks.items():
            expected[lba * 512:(lba + 1) * 512] = data
        expected[8192 * 512:8192 * 512 + len(big)] = big
        expected[12288 * 512:12288 * 512 + len(medium)] = medium
        assert os.path.getsize(path) == SIZE
        assert path.read_bytes() == expected

    run(main())


def test_write_zeroes_deallocate_readonly_and_errors(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "vol.img"
    ro_path = tmp_path / "ro.img"
    original = fill_file(path, SIZE)
    ro_data = fill_file(ro_path, 1 << 20, seed=3)
    big = tmp_path / "4k.img"
    cfg = config([port], [sub(namespaces=[ns(path, 1), ns(ro_path, 2, size=1 << 20, read_only=True),
                                          ns(big, 4, size=4 << 20, block_size=4096)])])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port)
            try:
                assert ctrl.namespaces[2].read_only
                # Write Zeroes
                await ctrl.write_zeroes(1, 100, 8)
                assert await ctrl.read(1, 100, 8) == bytes(8 * 512)
                # Deallocate 2 MiB: a hole is punched in the file.
                before = os.stat(path).st_blocks
                await ctrl.deallocate(1, [(4096, 4096), (0, 1)])
                after = os.stat(path).st_blocks
                assert before - after >= (2 << 20) // 512 - 16, (before, after)
                assert await ctrl.read(1, 4096, 16) == bytes(16 * 512)
                assert await ctrl.read(1, 1, 1) == original[512:1024]  # neighbour untouched
                # Read-only namespace: reads work, writes fail.
                assert await ctrl.read(2, 0, 4) == ro_data[:2048]
                for op in (ctrl.write(2, 0, b"x" * 512), ctrl.write_zeroes(2, 0, 1), ctrl.deallocate(2, [(0, 1)])):
                    with pytest.raises(NvmeError) as err:
                        await op
                    assert err.value.status == Status.NS_WRITE_PROTECTED
                # LBA out of range, invalid namespace.
                blocks = SIZE // 512
                with pytest.raises(NvmeError) as err:
                    await ctrl.read(1, blocks - 1, 2)
                assert err.value.status == Status.LBA_RANGE
                with pytest.raises(NvmeError) as err:
                    await ctrl.write(1, blocks, b"y" * 512)
                assert err.value.status == Status.LBA_RANGE
                with pytest.raises(NvmeError) as err:
                    await ctrl.deallocate(1, [(blocks - 1, 2)])
                assert err.value.status == Status.LBA_RANGE
                with pytest.raises(NvmeError) as err:
                    await ctrl.io_command(read_command(7, 0, 0), data_in=memoryview(bytearray(512)))
                assert err.value.status == Status.INVALID_NS
                with pytest.raises(NvmeError) as err:
                    await ctrl.flush(7)
                assert err.value.status == Status.INVALID_NS
                # 4096-byte LBAs.
                data = random.Random(4).randbytes(3 * 4096)
                await ctrl.write(4, 1023 - 2, data)
                assert await ctrl.read(4, 1023 - 2, 3) == data
                with pytest.raises(NvmeError) as err:
                    await ctrl.read(4, 1023, 2)
                assert err.value.status == Status.LBA_RANGE
                # Not a whole number of blocks: refused before anything is sent, queues unharmed.
                for op in (ctrl.write(4, 0, b"z" * 512), ctrl.read_into(4, 0, memoryview(bytearray(6000))),
                           ctrl.write(1, 0, b"")):
                    with pytest.raises(ValueError, match="blocks of"):
                        await op
                assert await ctrl.read(4, 1023 - 2, 3) == data
            finally:
                await ctrl.close()
        assert os.path.getsize(path) == SIZE and os.path.getsize(ro_path) == 1 << 20
        assert ro_path.read_bytes() == ro_data
        assert big.read_bytes()[-3 * 4096:] == data
        now = path.read_bytes()
        assert now[100 * 512:108 * 512] == bytes(8 * 512)
        assert now[:512] == bytes(512) and now[4096 * 512:8192 * 512] == bytes(2 << 20)
        assert now[512:100 * 512] == original[512:100 * 512]
        assert now[108 * 512:4096 * 512] == original[108 * 512:4096 * 512]
        assert now[8192 * 512:] == original[8192 * 512:]

    run(main())


def test_discovery_log_and_access_control(tmp_path: Path) -> None:
    p1, p2 = free_port(), free_port()
    cfg = config([p1, p2], [
        sub(NQN, [ns(tmp_path / "a.img")]),
        sub(NQN2, [ns(tmp_path / "b.img")], allow_any_host=False, hosts=["nqn.2014-08.org.nvmexpress:uuid:other"],
            serial="BLOCKDTEST0002"),
    ])

    async def main() -> None:
        async with serving(cfg) as service:
            entries = (await discover("127.0.0.1", p1, hostnqn=HOSTNQN)).entries
            kinds = [(e.subtype, e.subnqn, e.trsvcid) for e in entries]
            assert kinds[0] == (3, DISCOVERY_NQN, str(p1))
            assert kinds[1:] == [(2, NQN, str(p1))]  # NQN2 is not ours; p2's entries are p2's to give
            assert all(e.traddr == "127.0.0.1" and e.transport == "tcp" for e in entries)
            other = (await discover("127.0.0.1", p2, hostnqn="nqn.2014-08.org.nvmexpress:uuid:other")).entries
            assert sorted((e.subnqn, e.trsvcid) for e in other if e.subtype == 2) == sorted([(NQN, str(p2)), (NQN2, str(p2))])

            # GENCTR moves when the configuration changes.
            dctrl = await connect(p1, DISCOVERY_NQN, keep_alive_tmo=0)
            try:
                g1 = DISCOVERY_HEADER.parse(await dctrl.get_log_page(0x70, 1024)).genctr
                await service.reload(config([p1, p2], [sub(NQN, [ns(tmp_path / "a.img")])]))
                header = DISCOVERY_HEADER.parse(await dctrl.get_log_page(0x70, 1024))
                assert header.genctr > g1 and header.numrec == 2  # itself and NQN, both on p1
            finally:
                await dctrl.close()

            # Host not allowed; unknown NQN.
            await service.reload(cfg)
            with pytest.raises(ConnectError, match="not allowed"):
                await connect(p1, NQN2)
            with pytest.raises(ConnectError, match="no subsystem"):
                await connect(p1, "nqn.2026-11.io.blockd:missing")
            ok = await connect(p1, NQN2, hostnqn="nqn.2014-08.org.nvmexpress:uuid:other")
            await ok.close()
            await until(lambda: not service.target.controllers)

    run(main())


def test_keep_alive_timeout_tears_down_silent_host(tmp_path: Path) -> None:
    """A host silent past its KATO is torn down; one that sends Keep Alive outlives its own KATO.

    The margins hold on a busy machine: lateness only delays the silent host's teardown (the
    bound on it is loose) and the live host's Keep Alive goes every KATO/2, so one may be up to
    2 s late. The live host is then watched for more than twice its KATO with no other command
    (any command counts as keep-alive), so without its Keep Alives it would be gone.
    """
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])
    live_kato = 4.0

    async def main() -> None:
        async with serving(cfg) as service:
            live = await connect(port, keep_alive_tmo=live_kato)  # sends Keep Alive every 2 s
            live_since = time.monotonic()
            try:
                silent = await RawConn.open(port)
                await silent.initialize()
                cntlid = await silent.connect_admin(kato=1000)
                start = time.monotonic()  # the target's last sight of this host is after this
                await silent.enable()
                assert cntlid in service.target.controllers
                assert await silent.closed(timeout=15.0)
                assert time.monotonic() - start > 1.0  # not before its KATO ran out
                assert cntlid not in service.target.controllers
                await silent.close()
                await asyncio.sleep(max(0.0, live_since + 2.5 * live_kato - time.monotonic()))
                assert live.cntlid in service.target.controllers
                assert await live.read(1, 0, 1) == bytes(512)
            finally:
                await live.close()

    run(main())


def test_reconnect_after_target_restart(tmp_path: Path) -> None:
    port = free_port()
    path = tmp_path / "a.img"
    cfg = config([port], [sub(namespaces=[ns(path)])])

    async def main() -> None:
        service = TargetService(cfg)
        await service.start()
        ctrl = await connect(port, reconnect_delay=0.2, ctrl_loss_tmo=20)
        try:
            acked = random.Random(9).randbytes(64 << 10)
            await ctrl.write(1, 256, acked)
            await service.stop()
            # I/O issued while the target is down waits for the reconnect and then succeeds.
            pending = asyncio.ensure_future(ctrl.read(1, 256, len(acked) // 512))
            late_write = asyncio.ensure_future(ctrl.write(1, 2048, b"\x77" * 4096))
            await asyncio.sleep(0.5)
            assert not pending.done()
            service = TargetService(cfg)
            await service.start()
            assert await asyncio.wait_for(pending, 15) == acked
            await asyncio.wait_for(late_write, 15)
            assert await ctrl.read(1, 2048, 8) == b"\x77" * 4096
            assert ctrl.identity.cntlid == ctrl.cntlid
        finally:
            await ctrl.close()
            await service.stop()
        data = path.read_bytes()
        assert data[256 * 512:256 * 512 + len(acked)] == acked

    run(main())


def test_clean_disconnect_sets_shutdown(tmp_path: Path) -> None:
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])

    async def main() -> None:
        async with serving(cfg) as service:
            ctrl = await connect(port)
            tctrl = service.target.controllers[ctrl.cntlid]
            await ctrl.write(1, 0, b"\x01" * 512)
            await ctrl.close()
            assert (tctrl.csts >> 2) & 3 == 2  # SHST complete
            await until(lambda: tctrl.dead and not service.target.controllers)
            with pytest.raises(QueueLost):
                await ctrl.read(1, 0, 1)

    run(main())


def test_header_and_data_digests(tmp_path: Path) -> None:
    port = free_port()
    cfg = config([port], [sub(namespaces=[ns(tmp_path / "a.img")])])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port, hdr_digest=True, data_digest=True)
            try:
                rng = random.Random(5)
                small, large = rng.randbytes(4096), rng.randbytes(256 << 10)
                await asyncio.gather(ctrl.write(1, 0, small), ctrl.write(1, 1024, large))
                assert await ctrl.read(1, 0, 8) == small
                assert await ctrl.read(1, 1024, len(large) // 512) == large
                assert (await ctrl.identify_controller()).cntlid == ctrl.cntlid
            finally:
                await ctrl.close()

    run(main())


def test_aer_namespace_added_and_subsystem_removed(tmp_path: Path) -> None:
    port = free_port()
    base = [sub(NQN, [ns(tmp_path / "a.img")]), sub(NQN2, [ns(tmp_path / "b.img")], serial="BLOCKDTEST0002")]
    cfg = config([port], base)

    async def main() -> None:
        async with serving(cfg) as service:
            a = await connect(port, NQN)
            b = await connect(port, NQN2, reconnect_delay=0.2, ctrl_loss_tmo=1.0)
            try:
                # The host library keeps an AER outstanding; the namespace-changed event
                # (DW0 0x00040002) makes it read the Changed NS log and rescan.
                changed = asyncio.Event()
                a.namespace_listeners.append(changed.set)
                assert sorted(a.namespaces) == [1]
                grown = config([port], [sub(NQN, [ns(tmp_path / "a.img"), ns(tmp_path / "c.img", 2)]), base[1]])
                await service.reload(grown)
                await asyncio.wait_for(changed.wait(), 5)
                assert sorted(a.namespaces) == [1, 2]
                target_ctrl = service.target.controllers[a.cntlid]
                assert not target_ctrl.pending_events and not target_ctrl.changed_nsids
                ids = list(ACTIVE_NS_LIST.parse(await identify(a, Cns.ACTIVE_NS_LIST, 0)))
                assert ids[:3] == [1, 2, 0]

                # Remove NQN2: its host is torn down, NQN's host keeps working.
                b_cntlid = b.cntlid
                await service.reload(config([port], [sub(NQN, [ns(tmp_path / "a.img"), ns(tmp_path / "c.img", 2)])]))
                assert b_cntlid not in service.target.controllers
                await a.write(1, 5, b"\x42" * 512)
                assert await a.read(1, 5, 1) == b"\x42" * 512
                with pytest.raises((QueueLost, ConnectError, NvmeError)):
                    await asyncio.wait_for(b.read(1, 0, 1), 10)
                assert a.cntlid in service.target.controllers
            finally:
                await a.close()
                await b.close()

    run(main())
