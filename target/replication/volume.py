"""A replicated namespace's local copy as the replication layer sees it, and ``create-md``.

The copy is the namespace's backend, whole, with its metadata at its end; or, with
``metadata_path`` (external metadata, :mod:`target.replication.external`), the backend followed
by the metadata file. :func:`local_copy` builds it for the target service and for
:func:`create_md`, which formats the metadata of a volume that already holds data, offline
(the target must not have the namespace open).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from target.backend import Backend
from target.backend_registry import open_backend
from target.replication.blockio import BackendBlockIO
from target.replication.external import ExternalMetadata
from target.replication.metadata import create

if TYPE_CHECKING:
    from target.config import NamespaceConfig


def local_copy(backend: Backend, nc: NamespaceConfig, max_peers: int, create_meta: bool = False) -> Backend:
    """``backend`` as the copy the replication layer works on: itself (internal metadata at its
    end), or itself followed by ``nc.metadata_path``; closes ``backend`` when that fails."""
    if nc.metadata_path is None:
        return backend
    try:
        return ExternalMetadata.open(backend, nc.metadata_path, nc.region_size, max_peers, create=create_meta)
    except (OSError, ValueError):
        backend.close()
        raise


@dataclass(frozen=True)
class Created:
    """What ``create-md`` did, for the operator."""
    device_size: int
    """The copy's size: what every replica's namespace must have."""
    data_size: int
    """What the namespace exports from now on."""
    shrink: int
    """Bytes the data area lost to the metadata (0 with external metadata)."""
    metadata_path: str | None
    metadata_length: int
    generation: int


async def _create(copy: Backend, nc: NamespaceConfig, max_peers: int, force: bool) -> Created:
    md = await create(BackendBlockIO(copy), nc.region_size, max_peers, force=force)
    await copy.flush()
    backend_size = copy.data.size if isinstance(copy, ExternalMetadata) else copy.size
    return Created(device_size=copy.size, data_size=md.data_size, shrink=backend_size - md.data_size,
                   metadata_path=nc.metadata_path, metadata_length=md.layout.metadata_length,
                   generation=md.current)


def create_md(nc: NamespaceConfig, max_peers: int, force: bool = False) -> Created:
    """Format the replication metadata of namespace ``nc`` (configured with its replicas) on
    its storage, keeping its data. Raises ``OSError``/``ValueError`` (the storage) or
    :class:`~target.replication.metadata.MetadataError` (the area is not blank, see
    :func:`target.replication.metadata.create`), with nothing written."""
    copy = local_copy(open_backend(nc), nc, max_peers, create_meta=True)
    try:
        return asyncio.run(_create(copy, nc, max_peers, force))
    finally:
        copy.close()
