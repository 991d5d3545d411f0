"""ANA on the target: what Identify reports, the ANA log page, I/O statuses by group state, the
ANA change event, promotion rules, and the configuration keys (issue 14)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from blockd.config import ConfigError
from blockd.control_socket import RequestError
from initiator.controller import Controller
from initiator.errors import NvmeError
from protocol.commands import set_features_command
from protocol.constants import AEN_ANA_CHANGED, AEN_DW0_MASK, OAES_NS_ATTR, AnaState, FeatureId, LogPageId
from protocol.logpage import ANA_LOG
from protocol.status import Status
from target.config import parse
from target.service import TargetService

from .conftest import NQN, connect, fill_file, free_port, ns, run, serving, sub, until

SIZE = 1 << 20


def ana_config(ports: list[int], subsystems: list[dict[str, Any]], ana: list[dict[str, Any]] | None = None) -> Any:
    raw = {"port": [{"id": i + 1, "transport": "tcp", "address": "127.0.0.1", "port": p} for i, p in enumerate(ports)],
           "subsystem": subsystems, "control": {"socket": ""}, "ana": ana or []}
    return parse(raw, "test")


def _events(ctrl: Controller) -> asyncio.Queue[int]:
    """The completion DW0 of every asynchronous event other than namespace-changed."""
    events: asyncio.Queue[int] = asyncio.Queue()
    ctrl.event_listeners.append(events.put_nowait)
    return events


def code(exc: NvmeError) -> int:
    """SCT and SC, without DNR and More."""
    return exc.status & 0x7FF


def test_identify_reports_ana(tmp_path: Path) -> None:
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE), ns(tmp_path / "b.img", 3, SIZE)]),
                              sub(nqn=NQN + "-empty", serial="EMPTY")])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port)
            empty = await connect(port, nqn=NQN + "-empty")
            try:
                ident = await ctrl.identify_controller()
                assert ident.cmic == 0x0B  # multi-port, multi-controller, ANA reporting
                assert ident.oaes & (1 << 11) and ident.oaes & (1 << 8)
                assert (ident.anacap, ident.anatt, ident.anagrpmax, ident.nanagrpid) == (0x1F, 10, 128, 128)
                assert 1 <= ident.mnan <= ident.nn == 3
                e = await empty.identify_controller()
                assert (e.nn, e.mnan) == (1, 1)  # the Linux host refuses MNAN 0 (or > NN)
                nsid = await ctrl.identify_namespace(3)
                assert (nsid.anagrpid, nsid.nmic & 1, nsid.nuse) == (1, 1, nsid.nsze)
            finally:
                await ctrl.close()
                await empty.close()
    run(main())


def test_ana_log_page_and_odd_requests(tmp_path: Path) -> None:
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE), ns(tmp_path / "b.img", 2, SIZE)])],
                     ana=[{"group": 5, "state": "non-optimized"}])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port)
            try:
                page = await ctrl.get_log_page(LogPageId.ANA, 4096)
                parsed = ANA_LOG.parse(page)
                assert parsed.header.ngrps == 2
                g1, g5 = parsed.groups
                assert (g1.grpid, g1.state, list(g1.nsids)) == (1, AnaState.OPTIMIZED, [1, 2])
                assert (g5.grpid, g5.state, list(g5.nsids)) == (5, AnaState.NON_OPTIMIZED, [])
                assert g1.chgcnt == parsed.header.chgcnt >= 1
                size = 16 + 2 * 32 + 2 * 4
                assert not any(page[size:])  # the rest of the buffer is zero-filled
                rgo = ANA_LOG.parse(await ctrl.get_log_page(LogPageId.ANA, 4096, lsp=1))
                assert [(g.grpid, g.nnsids) for g in rgo.groups] == [(1, 0), (5, 0)]
                # an offset into the page returns the page's bytes from there
                assert await ctrl.get_log_page(LogPageId.ANA, 8, offset=16) == page[16:24]
                # exactly at the end: nothing left, zeros; past it: Invalid Field
                assert await ctrl.get_log_page(LogPageId.ANA, 4, offset=size) == bytes(4)
                with pytest.raises(NvmeError) as err:
                    await ctrl.get_log_page(LogPageId.ANA, 4, offset=size + 4)
                assert code(err.value) == Status.INVALID_FIELD & 0x7FF
                with pytest.raises(NvmeError) as err:  # not dword aligned
                    await ctrl.get_log_page(LogPageId.ANA, 8, offset=2)
                assert code(err.value) == Status.INVALID_FIELD & 0x7FF
                assert await ctrl.get_log_page(LogPageId.ANA, 4) == page[:4]  # a part of the header
                # the end is that of the page asked for: Return Groups Only's is 8 bytes sooner
                rgo_size = 16 + 2 * 32
                assert await ctrl.get_log_page(LogPageId.ANA, 4, offset=rgo_size, lsp=1) == bytes(4)
                with pytest.raises(NvmeError) as err:
                    await ctrl.get_log_page(LogPageId.ANA, 4, offset=rgo_size + 4, lsp=1)
                assert code(err.value) == Status.INVALID_FIELD & 0x7FF
            finally:
                await ctrl.close()
    run(main())


def test_io_status_follows_group_state_and_event(tmp_path: Path) -> None:
    """An inaccessible path refuses reads and writes with 0x302 (Identify shows NUSE 0), change
    gives 0x303, persistent loss 0x301 (NUSE 0 again); each change sends the ANA event to a host that enabled
    it, and the path serves I/O again once optimized."""
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])],
                     ana=[{"port": 1, "state": "inaccessible"}])

    async def main() -> None:
        async with serving(cfg) as service:
            ctrl = await connect(port)
            events = _events(ctrl)
            try:
                for op in (ctrl.write(1, 0, bytes(512)), ctrl.read(1, 0, 1)):
                    with pytest.raises(NvmeError) as err:
                        await op
                    assert code(err.value) == Status.ANA_INACCESSIBLE
                    assert not err.value.status & 0x4000  # no DNR: the host may retry elsewhere
                assert (await ctrl.identify_namespace(1)).nuse == 0
                for state, status in (("change", Status.ANA_TRANSITION),
                                      ("persistent-loss", Status.ANA_PERSISTENT_LOSS)):
                    await service.op_ana_set(state)
                    dw0 = await asyncio.wait_for(events.get(), 5)
                    assert dw0 & AEN_DW0_MASK == AEN_ANA_CHANGED
                    await ctrl.get_log_page(LogPageId.ANA, 4096)  # re-arms the event
                    with pytest.raises(NvmeError) as err:
                        await ctrl.write(1, 0, bytes(512))
                    assert code(err.value) == status
                    ident = await ctrl.identify_namespace(1)  # NUSE 0 in persistent loss, not in change
                    assert ident.nuse == (0 if state == "persistent-loss" else ident.nsze)
                reply = await service.op_ana_set("optimized", port=1)
                assert reply["changed"] and reply["ports"] == [1]
                assert (await asyncio.wait_for(events.get(), 5)) & AEN_DW0_MASK == AEN_ANA_CHANGED
                await ctrl.write(1, 0, b"x" * 512)
                assert await ctrl.read(1, 0, 1) == b"x" * 512
                state = ANA_LOG.parse(await ctrl.get_log_page(LogPageId.ANA, 4096)).groups[0].state
                assert state == AnaState.OPTIMIZED
            finally:
                await ctrl.close()
    run(main())


def test_a_standby_refuses_every_write_on_an_inaccessible_path(tmp_path: Path) -> None:
    """Hostile: a host that writes through the standby's inaccessible path anyway, with every
    command that changes data (in-capsule and R2T writes, FUA, Write Zeroes, deallocate), gets
    0x302 for each, and the file is untouched; a Flush of the namespace is refused too."""
    port = free_port()
    image = tmp_path / "a.img"
    data = fill_file(image, SIZE)
    cfg = ana_config([port], [sub(namespaces=[ns(image, 1, SIZE)])], ana=[{"state": "inaccessible"}])

    async def main() -> None:
        async with serving(cfg):
            ctrl = await connect(port)
            try:
                attempts = [ctrl.write(1, 0, b"w" * 512), ctrl.write(1, 8, b"R" * (256 << 10)),
                            ctrl.write(1, 1, b"f" * 512, fua=True), ctrl.write_zeroes(1, 0, 64),
                            ctrl.write_zeroes(1, 64, 64, deallocate=True), ctrl.deallocate(1, [(0, 128)]),
                            ctrl.flush(1)]
                for attempt in attempts:
                    with pytest.raises(NvmeError) as err:
                        await attempt
                    assert code(err.value) == Status.ANA_INACCESSIBLE
            finally:
                await ctrl.close()
        assert image.read_bytes() == data
    run(main())


def test_event_masked_until_log_read(tmp_path: Path) -> None:
    """As nvmet: a second change before the host read the log sends no second event."""
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])])

    async def main() -> None:
        async with serving(cfg) as service:
            ctrl = await connect(port)
            events = _events(ctrl)
            try:
                await service.op_ana_set("inaccessible")
                await asyncio.wait_for(events.get(), 5)
                await service.op_ana_set("change")
                await asyncio.sleep(0.3)
                assert events.empty()
                await ctrl.get_log_page(LogPageId.ANA, 4096)
                await service.op_ana_set("optimized")
                await asyncio.wait_for(events.get(), 5)
            finally:
                await ctrl.close()
    run(main())


def test_no_event_for_a_host_that_did_not_enable_it(tmp_path: Path) -> None:
    """Asynchronous Event Configuration bit 11 off: an ANA change (and a group move) sends that
    host no event, while a namespace change still reaches its outstanding AER."""
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])])

    async def main() -> None:
        async with serving(cfg) as service:
            ctrl = await connect(port)
            events = _events(ctrl)
            rescans: list[bool] = []
            ctrl.namespace_listeners.append(lambda: rescans.append(True))
            try:
                await ctrl.admin_command(set_features_command(FeatureId.ASYNC_EVENT_CONFIG, OAES_NS_ATTR))
                await service.op_ana_set("non-optimized")
                sub_ = service.target.subsystems[NQN]
                service.target.move_namespace(sub_, 1, 2)
                await asyncio.sleep(0.3)
                assert events.empty()
                service.target.resize_namespace(sub_, 1, 2 * SIZE)
                await until(lambda: bool(rescans))
                assert events.empty()
            finally:
                await ctrl.close()
    run(main())


def test_ana_set_refuses_bad_requests(tmp_path: Path) -> None:
    """(Promotion of a replicated copy, refused or forced: tests/replication/test_roles.py.)"""
    port = free_port()
    cfg = ana_config([port], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])], ana=[{"state": "inaccessible"}])

    async def main() -> None:
        async with serving(cfg) as service:
            reply = await service.op_ana_set("optimized")  # a plain file: always promotable
            assert reply["changed"] and service.target.ana.state(1, 1) == AnaState.OPTIMIZED
            with pytest.raises(RequestError, match="ANA state must be one of"):
                await service.op_ana_set("fast")
            with pytest.raises(RequestError, match="no port 9"):
                await service.op_ana_set("optimized", port=9)
            with pytest.raises(RequestError, match="ANA group must be 1..128"):
                await service.op_ana_set("optimized", group=129)
    run(main())


def test_reload_applies_changed_ana_entries(tmp_path: Path) -> None:
    port = free_port()
    subs = [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])]
    first = ana_config([port], subs, ana=[{"state": "inaccessible"}])

    async def main() -> None:
        async with serving(first) as service:
            ctrl = await connect(port)
            events = _events(ctrl)
            try:
                await service.reload(ana_config([port], subs, ana=[]))  # entry gone: optimized again
                assert service.target.ana.state(1, 1) == AnaState.OPTIMIZED
                await asyncio.wait_for(events.get(), 5)
                await ctrl.get_log_page(LogPageId.ANA, 4096)
                await service.reload(ana_config([port], subs, ana=[{"state": "non-optimized"}]))  # a new entry
                assert (await asyncio.wait_for(events.get(), 5)) & AEN_DW0_MASK == AEN_ANA_CHANGED
                assert ANA_LOG.parse(await ctrl.get_log_page(LogPageId.ANA, 4096)).groups[0].state == \
                    AnaState.NON_OPTIMIZED
                await service.reload(ana_config([port], subs, ana=[]))
                await asyncio.wait_for(events.get(), 5)
                await ctrl.get_log_page(LogPageId.ANA, 4096)
                await service.op_ana_set("non-optimized")  # a run-time change...
                await service.reload(ana_config([port], subs, ana=[]))  # ...survives an unchanged file
                assert service.target.ana.state(1, 1) == AnaState.NON_OPTIMIZED
            finally:
                await ctrl.close()
    run(main())


def test_cntlid_range_and_namespace_ids(tmp_path: Path) -> None:
    port = free_port()
    nguid = "00112233445566778899aabbccddeeff"
    cfg = ana_config([port], [sub(cntlid_min=0x100, cntlid_max=0x101, namespaces=[
        {**ns(tmp_path / "a.img", 1, SIZE), "nguid": nguid, "uuid": "12345678-1234-5678-9abc-def012345678",
         "eui64": "0102030405060708", "ana_group": 7}])])

    async def main() -> None:
        async with serving(cfg) as service:
            a = await connect(port)
            b = await connect(port)
            try:
                assert {a.cntlid, b.cntlid} == {0x100, 0x101}
                with pytest.raises(Exception, match="(?i)busy"):
                    await connect(port, ctrl_loss_tmo=0)
                ident = await a.identify_namespace(1)
                assert (ident.nguid.hex(), ident.eui64.hex(), ident.anagrpid) == (nguid, "0102030405060708", 7)
                page = ANA_LOG.parse(await a.get_log_page(LogPageId.ANA, 4096))
                assert [(g.grpid, list(g.nsids)) for g in page.groups] == [(1, []), (7, [1])]
                assert str(service.target.subsystems[NQN].namespaces[1].uuid) == "12345678-1234-5678-9abc-def012345678"
            finally:
                await a.close()
                await b.close()
    run(main())


@pytest.mark.parametrize("change, message", [
    ({"cntlid_min": 5, "cntlid_max": 4}, "cntlid_min and cntlid_max"),
    ({"cntlid_max": 0xFFF0}, "cntlid_min and cntlid_max"),
    ({"cntlid_min": 0}, "cntlid_min and cntlid_max"),
])
def test_cntlid_range_validated(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ana_config([4420], [sub(namespaces=[ns(tmp_path / "a.img")], **change)])


@pytest.mark.parametrize("change, message", [
    ({"nguid": "0011"}, "nguid must be 32 hexadecimal digits"),
    ({"nguid": "0" * 32}, "not all zero"),
    ({"eui64": "zz" * 8}, "eui64 must be 16"),
    ({"uuid": "not-a-uuid"}, "is not a UUID"),
    ({"ana_group": 129}, "ana_group must be 1..128"),
])
def test_namespace_ids_validated(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ana_config([4420], [sub(namespaces=[{**ns(tmp_path / "a.img"), **change}])])


@pytest.mark.parametrize("entry, message", [
    ({"state": "fast"}, "ANA state must be one of"),
    ({"state": "optimized", "port": 7}, "port 7 is not configured"),
    ({"state": "optimized", "group": 0}, "group must be 1..128"),
])
def test_ana_entries_validated(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ana_config([4420], [], ana=[entry])


def test_ana_entry_for_one_port_overrides_every_port(tmp_path: Path) -> None:
    p1, p2 = free_port(), free_port()
    cfg = ana_config([p1, p2], [sub(namespaces=[ns(tmp_path / "a.img", 1, SIZE)])],
                     ana=[{"port": 2, "state": "optimized"}, {"state": "inaccessible"}])

    async def main() -> None:
        service = TargetService(cfg)
        await service.start()
        try:
            assert service.target.ana.state(1, 1) == AnaState.INACCESSIBLE
            assert service.target.ana.state(2, 1) == AnaState.OPTIMIZED
            shown = (await service.op_ana())["ana"]
            assert [(e["port"], e["state"], e["namespaces"]) for e in shown] == [
                (1, "inaccessible", [f"{NQN}/1"]), (2, "optimized", [f"{NQN}/1"])]
        finally:
            await service.stop()
    run(main())


def test_reload_moves_a_namespace_to_another_group_in_place(tmp_path: Path) -> None:
    """A reload that changes ``ana_group`` keeps the namespace attached (the same backend, no
    Namespace Attribute Changed, the host's namespace list untouched): the host gets the ANA
    change event, finds the namespace in its new group in the log and in Identify Namespace,
    and I/O goes on through the move; into an inaccessible group it gets 0x302, and back the
    data written before is there. (A move that would make a standby's copy accessible is a
    promotion: tests/replication/test_roles.py.)"""
    port = free_port()
    ana = [{"group": 2, "state": "inaccessible"}]

    def cfg(group: int) -> Any:
        return ana_config([port], [sub(namespaces=[{**ns(tmp_path / "a.img", 1, SIZE), "ana_group": group}])], ana=ana)

    async def main() -> None:
        async with serving(cfg(1)) as service:
            ctrl = await connect(port)
            events = _events(ctrl)
            rescans: list[bool] = []
            ctrl.namespace_listeners.append(lambda: rescans.append(True))
            backend = service.target.subsystems[NQN].namespaces[1].backend
            stop = asyncio.Event()
            written: list[int] = []

            async def load() -> None:  # a write and its read-back, until told to stop
                n = 0
                while not stop.is_set():
                    data = n.to_bytes(4, "little") * 128
                    await ctrl.write(1, 8 + n % 64, data)
                    assert await ctrl.read(1, 8 + n % 64, 1) == data
                    written.append(n)
                    n += 1

            try:
                chgcnt = service.target.ana.chgcnt
                await ctrl.write(1, 0, b"before" * 85 + b"xx")
                writer = asyncio.create_task(load())
                await asyncio.sleep(0.1)
                await service.reload(cfg(3))  # group 3: optimized, as every group not set
                assert (await asyncio.wait_for(events.get(), 5)) & AEN_DW0_MASK == AEN_ANA_CHANGED
                seen = len(written)
                await asyncio.sleep(0.2)
                stop.set()
                await writer  # no I/O error across the move
                assert len(written) > seen
                parsed = ANA_LOG.parse(await ctrl.get_log_page(LogPageId.ANA, 4096))
                assert {g.grpid: list(g.nsids) for g in parsed.groups} == {1: [], 2: [], 3: [1]}
                assert parsed.header.chgcnt == chgcnt + 1
                assert (await ctrl.identify_namespace(1)).anagrpid == 3

                await service.reload(cfg(2))  # into the inaccessible group
                assert (await asyncio.wait_for(events.get(), 5)) & AEN_DW0_MASK == AEN_ANA_CHANGED
                with pytest.raises(NvmeError) as err:
                    await ctrl.read(1, 0, 1)
                assert code(err.value) == Status.ANA_INACCESSIBLE
                ident = await ctrl.identify_namespace(1)
                assert (ident.anagrpid, ident.nuse) == (2, 0)
                parsed = ANA_LOG.parse(await ctrl.get_log_page(LogPageId.ANA, 4096))
                assert [(g.grpid, g.state, list(g.nsids)) for g in parsed.groups if g.nsids] == [
                    (2, AnaState.INACCESSIBLE, [1])]

                await service.reload(cfg(1))
                await asyncio.wait_for(events.get(), 5)
                assert await ctrl.read(1, 0, 1) == b"before" * 85 + b"xx"
                await ctrl.write(1, 1, b"after!" * 85 + b"yy")
                assert await ctrl.read(1, 1, 1) == b"after!" * 85 + b"yy"
                assert service.target.subsystems[NQN].namespaces[1].backend is backend
                assert not rescans and sorted(ctrl.namespaces) == [1]
            finally:
                await ctrl.close()
    run(main())
