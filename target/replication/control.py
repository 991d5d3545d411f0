"""The target control socket's replication verbs (``blockctl target replicas|verify|resolve``).

* ``replicas``: every replicated namespace with each replica's state (in sync, degraded,
  resyncing with percent, MB/s and ETA, split brain, refused) and why;
* ``verify``: compare a namespace's copies region by region (all in-sync replicas, or one),
  report the regions that differ and mark them for resync; the reply comes when it is done;
* ``resolve``: end a split brain (or a refusal) by discarding one side's writes: the replica's
  (it is overwritten from this copy at its next connection), or this copy's (with one replica:
  the replica's data is copied over this copy at once, host I/O waiting with Namespace Not Ready).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from blockd.control_socket import RequestError
from target.replication.link import IN_SYNC
from target.replication.metadata import MetadataError
from target.replication.mirror import LINK_ERRORS, ReplicatedBackend
from target.replication.resolve import discard_local, discard_replica
from target.replication.verify import verify

if TYPE_CHECKING:
    from target.control import ControlServer
    from target.target import Target


class ReplicationControl:
    def __init__(self, target: Target) -> None:
        self.target = target

    def add_verbs(self, control: ControlServer) -> None:
        control.add_verb("replicas", self.op_replicas)
        control.add_verb("verify", self.op_verify)
        control.add_verb("resolve", self.op_resolve)

    def _replicated(self) -> list[tuple[str, int, ReplicatedBackend]]:
        return [(sub.nqn, ns.nsid, ns.backend) for sub in self.target.subsystems.values()
                for ns in sub.namespaces.values() if isinstance(ns.backend, ReplicatedBackend)]

    def _one(self, nqn: str, nsid: int) -> ReplicatedBackend:
        for sub_nqn, ns_id, backend in self._replicated():
            if (sub_nqn, ns_id) == (nqn, nsid):
                if not backend.primary:
                    raise RequestError(f"{nqn} namespace {nsid} is the standby (secondary): run this on its primary")
                return backend
        raise RequestError(f"{nqn} has no replicated namespace {nsid}")

    async def op_replicas(self) -> dict[str, Any]:
        for _, _, backend in self._replicated():
            if not backend.primary:  # its primary writes its metadata: show what is on disk now
                with contextlib.suppress(OSError, MetadataError):
                    await backend.reread_metadata()
        return {"namespaces": [{"subsystem": nqn, "nsid": nsid, **backend.view()}
                               for nqn, nsid, backend in self._replicated()]}

    async def op_verify(self, nqn: str, nsid: int, replica: str | None = None) -> dict[str, Any]:
        backend = self._one(nqn, nsid)
        try:
            links = [backend.link(replica)] if replica is not None else [
                link for link in backend.links if link.state == IN_SYNC]
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if not links:
            raise RequestError(f"{nqn} namespace {nsid}: no replica is in sync, nothing to verify")
        results = []
        for link in links:
            try:
                results.append(await verify(backend, link))
            except LINK_ERRORS as exc:
                raise RequestError(f"verify of {link.name}: {exc}") from None
        return {"subsystem": nqn, "nsid": nsid, "replicas": results}

    async def op_resolve(self, nqn: str, nsid: int, replica: str, discard: str = "replica") -> dict[str, Any]:
        backend = self._one(nqn, nsid)
        try:
            if discard == "replica":
                link = discard_replica(backend, replica)
            elif discard == "local":
                link = await discard_local(backend, replica)
            else:
                raise RequestError(f"discard must be 'replica' or 'local', not {discard!r}")
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        except LINK_ERRORS as exc:
            raise RequestError(f"discarding this copy failed, it is unchanged or flagged inconsistent: {exc}") from None
        return {"subsystem": nqn, "nsid": nsid, "replica": link.name, "state": link.state}
