"""FUSE mounts of the initiator daemon: each namespace of a connection as a file (``ns1``, ...).

The kernel's FUSE protocol is spoken on ``/dev/fuse`` straight from the daemon's asyncio loop.
One module per concern:

- ``abi``: the kernel ABI (opcodes, flags, message layouts);
- ``session``: the request loop (reading /dev/fuse, batching, replies, INIT, INTERRUPT);
- ``blockfile``: block-device semantics of the namespace files (read-modify-write, zeroing,
  errno mapping in ``errors``), with ``rangelock`` ordering overlapping writes;
- ``directory``: the metadata requests of the mount's one directory;
- ``kernel_mount``: mount(2)/fusermount3 and unmounting, off the event loop;
- ``mount``: one mount's life; ``mounts``: the daemon's mount verbs;
- ``needs``: what a mount needs from a controller.
"""

from initiator.fuse.mount import FuseMount
from initiator.fuse.mounts import FuseMounts, MountError

__all__ = ["FuseMount", "FuseMounts", "MountError"]
