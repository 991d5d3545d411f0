"""The target daemon's control socket: live state and counters, and the verbs that change a
running target.

The protocol is the initiator's (:mod:`initiator.control`): one JSON request line
``{"op": "<verb>", ...arguments}`` per connection, one JSON reply line ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``. The socket is root-only (:mod:`blockd.control_socket`).

Verbs are a table (:attr:`ControlServer.verbs`): a later feature adds its own with
:meth:`ControlServer.add_verb`. The views (:func:`ports`, :func:`namespaces`, :func:`hosts`,
:func:`counters`) are plain functions of the :class:`target.target.Target`, shared with the
Prometheus exporter (:mod:`target.metrics`) so both show the same numbers.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog

from blockd import control_socket
from target.config import DEFAULT_CONTROL_SOCKET
from blockd.control_socket import RequestError
from blockd.iostats import interval

if TYPE_CHECKING:
    from target.controller import Controller
    from target.service import TargetService
    from target.target import Target

log = structlog.get_logger("blockd.target.control")

MAX_INTERVAL = 60.0
"""Longest ``stats`` interval a request may ask for (the connection waits that long)."""

Verb = Callable[..., Awaitable[dict[str, Any]]]


def socket_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get("BLOCKD_TARGET_SOCKET", DEFAULT_CONTROL_SOCKET)


# -- views of the running target -------------------------------------------------------------


def ports(target: Target) -> list[dict[str, Any]]:
    return [{"id": p.port_id, "transport": p.transport, "address": p.address, "service": p.service}
            for p in target.ports.values()]


def namespaces(target: Target) -> list[dict[str, Any]]:
    out = []
    for sub in target.subsystems.values():
        if sub.is_discovery:
            continue
        for ns in sub.namespaces.values():
            out.append({"subsystem": sub.nqn, "nsid": ns.nsid, "size": ns.backend.size,
                        "block_size": ns.block_size, "blocks": ns.blocks,
                        "backend": type(ns.backend).__name__, "path": ns.path,
                        "read_only": ns.read_only})
    return out


def _host(ctrl: Controller) -> dict[str, Any]:
    admin = ctrl.queues.get(0)
    return {
        "hostnqn": ctrl.hostnqn, "cntlid": ctrl.cntlid, "subsystem": ctrl.subsystem.nqn,
        "peer": admin.peer if admin is not None else "", "transport": ctrl.transport.name,
        "port": ctrl.port_id, "keep_alive_ms": ctrl.kato_ms,
        "connected_since": datetime.datetime.fromtimestamp(
            ctrl.connected_ns / 1e9, datetime.timezone.utc).isoformat(timespec="seconds"),
        "queues": [{"qid": qid, "depth": q.sqsize + 1, "in_flight": q.in_flight, "served_by": q.transport.served_by()}
                   for qid, q in sorted(ctrl.queues.items())],
    }


def hosts(target: Target) -> list[dict[str, Any]]:
    """Every live association with an NVM subsystem (discovery controllers come and go)."""
    return [_host(c) for c in target.controllers.values() if not c.is_discovery]


def counters(target: Target) -> dict[str, Any]:
    """Cumulative counters of every namespace and every connected host, and the refusals by
    reason (:mod:`target.rejections`), with the monotonic time they were read at (two of these
    make an interval: :func:`blockd.iostats.interval`)."""
    return {
        "time_ns": time.monotonic_ns(),
        "rejections": dict(target.rejections.counts),
        "namespaces": [{"subsystem": sub.nqn, "nsid": ns.nsid, **ns.counters.snapshot()}
                       for sub in target.subsystems.values() for ns in sub.namespaces.values()],
        "hosts": [{"hostnqn": c.hostnqn, "cntlid": c.cntlid, "subsystem": c.subsystem.nqn,
                   **c.counters.snapshot()}
                  for c in target.controllers.values() if not c.is_discovery],
    }


def counters_interval(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Per namespace and per host: what :func:`blockd.iostats.interval` makes of two
    :func:`counters` readings (``before`` None: everything since each was created)."""
    seconds = (after["time_ns"] - before["time_ns"]) / 1e9 if before else 0.0

    def pair(kind: str, key: Callable[[dict[str, Any]], tuple[Any, ...]]) -> list[dict[str, Any]]:
        old = {key(e): e for e in before[kind]} if before else {}
        return [{"subsystem": e["subsystem"], **({"nsid": e["nsid"]} if kind == "namespaces" else
                                                 {"hostnqn": e["hostnqn"], "cntlid": e["cntlid"]}),
                 **interval(old.get(key(e)), e, seconds)}
                for e in after[kind]]

    old_rejections = before["rejections"] if before else {}
    return {"seconds": seconds,
            "rejections": {k: v - old_rejections.get(k, 0) for k, v in after["rejections"].items()},
            "namespaces": pair("namespaces", lambda e: (e["subsystem"], e["nsid"])),
            "hosts": pair("hosts", lambda e: (e["subsystem"], e["cntlid"]))}


# -- the server --------------------------------------------------------------------------------


class ControlServer:
    """Serves the control verbs of one :class:`target.service.TargetService`."""

    def __init__(self, service: TargetService, path: str) -> None:
        self.service = service
        self.path = path
        self.server: asyncio.base_events.Server | None = None
        self.verbs: dict[str, Verb] = {
            "status": self.op_status,
            "namespaces": self.op_namespaces,
            "hosts": self.op_hosts,
            "counters": self.op_counters,
            "stats": self.op_stats,
        }

    def add_verb(self, name: str, handler: Verb) -> None:
        """Offer one more verb; ``handler(**arguments)`` returns the reply's fields or raises
        :class:`RequestError`."""
        if name in self.verbs:
            raise ValueError(f"control verb {name!r} already exists")
        self.verbs[name] = handler

    async def start(self) -> None:
        self.server = await control_socket.listen_private(self.path, self._client)
        log.info("target control socket listening", socket=self.path)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            control_socket.remove(self.path)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await control_socket.serve_request(reader, writer, self._dispatch, (), log)

    async def _dispatch(self, op: str, req: dict[str, Any]) -> dict[str, Any]:
        handler = self.verbs.get(op)
        if handler is None:
            raise RequestError(f"unknown request {op!r}")
        return await handler(**req)

    # -- verbs -------------------------------------------------------------------------------

    async def op_status(self) -> dict[str, Any]:
        target = self.service.target
        return {"status": self.service.describe(), "ports": ports(target),
                "namespaces": namespaces(target), "hosts": hosts(target)}

    async def op_namespaces(self) -> dict[str, Any]:
        return {"namespaces": namespaces(self.service.target)}

    async def op_hosts(self) -> dict[str, Any]:
        return {"hosts": hosts(self.service.target)}

    async def op_counters(self) -> dict[str, Any]:
        """Cumulative counters; the caller makes intervals (``blockctl iostat``)."""
        return counters(self.service.target)

    async def op_stats(self, interval: float = 1.0) -> dict[str, Any]:
        """Counters over the next ``interval`` seconds (rates, mean and p99 latency), with the
        cumulative counters at its end."""
        if not 0 < interval <= MAX_INTERVAL:
            raise RequestError(f"interval must be more than 0 and at most {MAX_INTERVAL:g} seconds")
        target = self.service.target
        before = counters(target)
        await asyncio.sleep(interval)
        after = counters(target)
        return {"interval": counters_interval(before, after), "totals": after}
