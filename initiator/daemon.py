"""``blockd initiator``: holds named NVMe-oF connections and serves blockctl (see control.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

import structlog

from blockd import control_socket
from blockd.config import MetricsConfig
from blockd.control_socket import RequestError
from blockd.prometheus import MetricsServer
from initiator.control import CHUNK, socket_path
from initiator.controller import Controller
from initiator import reservations
from initiator.errors import ConnectError, NvmeError, QueueLost
from initiator.fuse import FuseMounts
from initiator.metrics import initiator_metrics_server
from initiator.multipath import MultipathController, parse_path
from initiator.params import connect_params
from protocol.constants import DEFAULT_IO_PORT

log = structlog.get_logger("blockd.initiator.daemon")

PIPELINE = 8
"""Chunks of a read kept in flight at once."""


class InitiatorDaemon:
    """Named connections plus the control socket server."""

    def __init__(self, path: str | None = None, metrics: MetricsConfig | None = None) -> None:
        self.path = socket_path(path)
        self.connections: dict[str, Controller | MultipathController] = {}
        self.server: asyncio.base_events.Server | None = None
        self.mounts = FuseMounts(self.connections, self.find)
        self.handlers: dict[str, Callable[..., Awaitable[dict[str, Any] | None]]] = {
            "connect": self.op_connect,
            "disconnect": self.op_disconnect,
            "list": self.op_list,
            "counters": self.op_counters,
            "id-ctrl": self.op_id_ctrl,
            "id-ns": self.op_id_ns,
            "mount": self.mounts.op_mount,
            "umount": self.mounts.op_umount,
            "mounts": self.mounts.op_mounts,
            "resv-register": self.op_resv_register,
            "resv-acquire": self.op_resv_acquire,
            "resv-release": self.op_resv_release,
            "resv-report": self.op_resv_report,
        }
        self.metrics: MetricsServer | None = (
            initiator_metrics_server(self, metrics.address, metrics.port) if metrics is not None else None)
        """The Prometheus endpoint, when the configuration enables it."""

    async def start(self) -> None:
        self.server = await control_socket.listen_private(self.path, self._client, limit=CHUNK * 2)
        log.info("initiator listening", socket=self.path)
        if self.metrics is not None:
            await self.metrics.start()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.metrics is not None:
            await self.metrics.stop()
        await self.mounts.stop()
        for name, ctrl in list(self.connections.items()):
            await ctrl.close()
            log.info("disconnected", name=name)
        self.connections.clear()
        control_socket.remove(self.path)

    def find(self, name: str) -> Controller | MultipathController:
        """A connection by its name, or by its subsystem NQN when that is unambiguous."""
        if name in self.connections:
            return self.connections[name]
        matches = [c for c in self.connections.values() if c.params.subnqn == name]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise RequestError(f"several connections to {name}; use the connection name")
        raise RequestError(f"no connection named {name!r} (see 'blockctl list')")

    # -- request loop ---------------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def dispatch(op: str, req: dict[str, Any]) -> dict[str, Any] | None:
            if op == "read":
                await self.op_read(writer, **req)
                return None
            if op == "write":
                await self.op_write(reader, writer, **req)
                return None
            handler = self.handlers.get(op)
            if handler is None:
                raise RequestError(f"unknown request {op!r}")
            return await handler(**req) or {}

        await control_socket.serve_request(reader, writer, dispatch, (ConnectError, NvmeError, QueueLost), log)

    # -- operations -----------------------------------------------------------------------------------

    async def op_connect(self, name: str | None = None, paths: list[str] | None = None,
                         **options: Any) -> dict[str, Any]:
        """Connect with the connect options (``initiator.params``: absent ones take their
        default) under ``name`` (default: the NQN). ``paths`` (``ADDR[:PORT]`` each) makes a
        multipath connection, one path per entry with the same options (initiator.multipath)."""
        try:
            if paths:
                default_port = options.get("trsvcid") or DEFAULT_IO_PORT
                every = [connect_params({**options, "traddr": a, "trsvcid": p})
                         for a, p in (parse_path(text, default_port) for text in paths)]
                params = every[0]
            else:
                params = connect_params(options)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        name = name or params.subnqn
        if name in self.connections:
            raise RequestError(f"a connection named {name!r} already exists")
        ctrl: Controller | MultipathController = (
            await MultipathController.connect(every) if paths else await Controller.connect(params))
        self.connections[name] = ctrl
        log.info("connected", name=name, nqn=params.subnqn, traddr=params.traddr, transport=params.transport,
                 cntlid=ctrl.cntlid, io_queues=len(ctrl.io))
        return {"name": name, **self._describe(name, ctrl)}

    async def op_disconnect(self, name: str) -> dict[str, Any]:
        ctrl = self.find(name)
        for key, value in list(self.connections.items()):
            if value is ctrl:
                del self.connections[key]
        await ctrl.close()
        return {}

    async def op_list(self) -> dict[str, Any]:
        return {"connections": [{"name": n, **self._describe(n, c)} for n, c in self.connections.items()]}

    async def op_counters(self) -> dict[str, Any]:
        """Each connection's cumulative I/O counters (blockd.iostats), with the monotonic time
        they were read at: ``blockctl iostat --initiator`` makes intervals of two."""
        return {"time_ns": time.monotonic_ns(),
                "connections": [{"name": n, "nqn": c.params.subnqn, "cntlid": c.cntlid,
                                 **c.counters.snapshot()} for n, c in self.connections.items()]}

    def _describe(self, name: str, ctrl: Controller | MultipathController) -> dict[str, Any]:
        p = ctrl.params
        multipath = ctrl.describe() if isinstance(ctrl, MultipathController) else {"paths": []}
        return {"nqn": p.subnqn, "transport": p.transport, "traddr": p.traddr, "trsvcid": p.trsvcid,
                "cntlid": ctrl.cntlid, "io_queues": len(ctrl.io),
                "state": ctrl.state, **multipath,
                "namespaces": [{"nsid": ns.nsid, "size": ns.size, "block_size": ns.block_size,
                                "read_only": ns.read_only} for ns in ctrl.namespaces.values()]}

    async def op_id_ctrl(self, name: str) -> dict[str, Any]:
        ident = await self.find(name).identify_controller()
        return {"identify": _plain(ident)}

    async def op_id_ns(self, name: str, nsid: int) -> dict[str, Any]:
        ident = await self.find(name).identify_namespace(nsid)
        return {"identify": _plain(ident)}

    async def op_resv_register(self, name: str, nsid: int, rrega: int, crkey: int, nrkey: int,
                               iekey: bool, cptpl: int) -> None:
        await reservations.register(self.find(name), nsid, rrega, crkey, nrkey, iekey, cptpl)

    async def op_resv_acquire(self, name: str, nsid: int, racqa: int, rtype: int, crkey: int, prkey: int,
                              iekey: bool) -> None:
        await reservations.acquire(self.find(name), nsid, racqa, rtype, crkey, prkey, iekey)

    async def op_resv_release(self, name: str, nsid: int, rrela: int, rtype: int, crkey: int, iekey: bool) -> None:
        await reservations.release(self.find(name), nsid, rrela, rtype, crkey, iekey)

    async def op_resv_report(self, name: str, nsid: int) -> dict[str, Any]:
        status = await reservations.report(self.find(name), nsid)
        return {"generation": status.generation, "rtype": status.rtype, "ptpl": status.ptpl,
                "registrants": [{"hostid": r.hostid.hex(), "key": r.key, "holds": r.holds, "cntlid": r.cntlid}
                                for r in status.registrants]}

    async def op_read(self, writer: asyncio.StreamWriter, name: str, nsid: int, offset: int,
                      length: int) -> None:
        ctrl = self.find(name)
        ctrl.check_range(nsid, offset, length)
        chunks = [(pos, min(CHUNK, length - pos)) for pos in range(0, length, CHUNK)]
        reads = [asyncio.ensure_future(ctrl.read_bytes(nsid, offset + pos, n)) for pos, n in chunks[:PIPELINE]]
        header_sent = False
        try:
            for i in range(len(chunks)):
                data = await reads[i]
                if i + PIPELINE < len(chunks):
                    pos, n = chunks[i + PIPELINE]
                    reads.append(asyncio.ensure_future(ctrl.read_bytes(nsid, offset + pos, n)))
                if not header_sent:
                    writer.write(json.dumps({"ok": True, "length": length}).encode() + b"\n")
                    header_sent = True
                writer.write(data)
                await writer.drain()
            if not header_sent:
                writer.write(json.dumps({"ok": True, "length": 0}).encode() + b"\n")
        except BaseException:
            for fut in reads:
                fut.cancel()
            if header_sent:  # too late for an error line: cut the stream so the client sees it short
                writer.transport.abort()
                return
            raise

    async def op_write(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str,
                       nsid: int, offset: int, length: int, fua: bool = False) -> None:
        ctrl = self.find(name)
        ctrl.check_range(nsid, offset, length)
        done = 0
        writes: list[asyncio.Future[None]] = []
        try:
            while done < length:
                n = min(CHUNK, length - done)
                data = await reader.readexactly(n)
                writes.append(asyncio.ensure_future(ctrl.write_bytes(nsid, offset + done, data, fua)))
                done += n
                if len(writes) >= PIPELINE:
                    await writes.pop(0)
            await asyncio.gather(*writes)
        except BaseException:
            for fut in writes:
                fut.cancel()
            raise
        writer.write(json.dumps({"ok": True, "written": length}).encode() + b"\n")


def _plain(obj: Any) -> Any:
    """construct Containers → JSON-friendly dicts (bytes as hex)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    return obj
