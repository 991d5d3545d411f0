"""The FUSE opcode table: one row per opcode the mount serves, as libfuse's ``fuse_ll_ops[]``.

A row names the opcode, what serves it and whether the compiled loop serves it itself. The
session binds every row once (:meth:`initiator.fuse.session.FuseSession.serve`); a handler is
called as ``handler(unique, nodeid, arg)`` with ``arg`` the request after its header, replies
itself (or raises :class:`initiator.fuse.errors.FsError`, answered with its errno), and an
opcode with no row is answered ENOSYS. Adding an operation is one handler and one row.

``compiled`` rows are the per-I/O ones ``initiator/fuse/_loop.pyx`` serves in C in their common
case (it reads their opcodes from this table when a session makes it); it hands every other
request, and the uncommon cases of its own, to the same Python handlers.
"""

from __future__ import annotations

from dataclasses import dataclass

from initiator.fuse.abi import (
    ACCESS, BATCH_FORGET, DESTROY, FALLOCATE, FLUSH, FORGET, FSYNC, FSYNCDIR, GETATTR, INIT, INTERRUPT,
    LOOKUP, OPEN, OPENDIR, READ, READDIR, RELEASE, RELEASEDIR, SETATTR, STATFS, WRITE,
)


@dataclass(frozen=True)
class FuseOp:
    """How one opcode is served."""

    name: str
    """The opcode's name in ``include/uapi/linux/fuse.h`` (without ``FUSE_``), for logs."""
    owner: str
    """``session`` (:class:`~initiator.fuse.session.FuseSession`: I/O and the connection's own
    requests) or ``directory`` (:class:`~initiator.fuse.directory.NamespaceDir`: metadata)."""
    method: str
    """The owner's method that serves it."""
    compiled: bool = False
    """The compiled loop serves its common case itself."""


OPS: dict[int, FuseOp] = {
    LOOKUP: FuseOp("LOOKUP", "directory", "lookup"),
    FORGET: FuseOp("FORGET", "session", "forget"),
    GETATTR: FuseOp("GETATTR", "directory", "get_attr"),
    SETATTR: FuseOp("SETATTR", "directory", "set_attr"),
    OPEN: FuseOp("OPEN", "directory", "open"),
    READ: FuseOp("READ", "session", "read", compiled=True),
    WRITE: FuseOp("WRITE", "session", "write", compiled=True),
    STATFS: FuseOp("STATFS", "directory", "statfs"),
    RELEASE: FuseOp("RELEASE", "session", "ok"),
    FSYNC: FuseOp("FSYNC", "session", "fsync", compiled=True),
    FLUSH: FuseOp("FLUSH", "session", "ok"),
    INIT: FuseOp("INIT", "session", "init"),
    OPENDIR: FuseOp("OPENDIR", "directory", "opendir"),
    READDIR: FuseOp("READDIR", "directory", "readdir"),
    RELEASEDIR: FuseOp("RELEASEDIR", "session", "ok"),
    FSYNCDIR: FuseOp("FSYNCDIR", "session", "ok"),
    ACCESS: FuseOp("ACCESS", "session", "ok"),
    INTERRUPT: FuseOp("INTERRUPT", "session", "interrupt"),
    DESTROY: FuseOp("DESTROY", "session", "ok"),
    BATCH_FORGET: FuseOp("BATCH_FORGET", "session", "forget"),
    FALLOCATE: FuseOp("FALLOCATE", "session", "fallocate"),
}
"""Opcode -> how it is served; every other opcode is answered ENOSYS."""


def compiled_opcodes() -> dict[str, int]:
    """Name -> opcode of the rows the compiled loop serves itself."""
    return {op.name: opcode for opcode, op in OPS.items() if op.compiled}
