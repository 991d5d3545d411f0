"""Putting a FUSE file system into the mount table and taking it out again: mount(2) when we are
root, the setuid ``fusermount3`` helper otherwise.

Every call here resolves a path and may therefore wait on a FUSE server, our own included (a
mountpoint inside our mount, or the mount root itself whose cached attributes have expired).
The daemon serves its mounts from its event loop thread, so these calls must never run on it:
``off_loop`` runs them on a thread of their own, with a bound.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import subprocess
import threading
from typing import Any, Callable, TypeVar

from blockd.linux_files import check, libc

T = TypeVar("T")

libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2


def _run(args: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a fusermount3 command; TimeoutError (as ``off_loop`` raises) once ``timeout`` passed."""
    try:
        return subprocess.run(args, capture_output=True, text=True, check=False, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{args[0]} did not finish within {timeout} s") from None


def options(uid: int, gid: int) -> str:
    """The mount options both ways of mounting pass."""
    return f"rootmode=40000,user_id={uid},group_id={gid},default_permissions"


def open_device() -> int:
    """A new FUSE connection: /dev/fuse, non-blocking (the loop reads it when readable)."""
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)


def mount_device(fd: int, mountpoint: str, opts: str, max_read: int) -> None:
    """mount(2) the connection ``fd`` at ``mountpoint`` (root only). It does not wait for INIT."""
    data = f"fd={fd},{opts},allow_other,max_read={max_read}"
    check(libc.mount(b"blockd", mountpoint.encode(), b"fuse.blockd", MS_NOSUID | MS_NODEV, data.encode()),
          f"mount {mountpoint}")


def fusermount(mountpoint: str, opts: str, timeout: float) -> int:
    """Mount through the setuid fusermount3 helper; the /dev/fuse fd it passes back."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = _run(["fusermount3", "-o", f"{opts},fsname=blockd,subtype=blockd", "--", mountpoint],
                    timeout, env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        if proc.returncode:
            raise OSError(errno.EPERM, f"fusermount3: {proc.stderr.strip()}")
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise OSError(errno.EIO, "fusermount3 passed no file descriptor")
        return fds[0]
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def unmount(mountpoint: str, lazy: bool, via_fusermount: bool, timeout: float) -> None:
    """Take ``mountpoint`` out of the mount table; EBUSY while files are open unless ``lazy``
    (MNT_DETACH: gone from the namespace at once, open files keep the connection)."""
    if via_fusermount:
        args = ["fusermount3", "-u"] + (["-z"] if lazy else []) + ["--", mountpoint]
        proc = _run(args, timeout)
        if proc.returncode:
            raise OSError(errno.EBUSY, proc.stderr.strip() or "fusermount3 -u failed")
    else:
        check(libc.umount2(mountpoint.encode(), MNT_DETACH if lazy else 0), f"umount {mountpoint}")


async def off_loop(call: Callable[[], T], timeout: float) -> T:
    """``call()`` on a thread of its own, awaited for at most ``timeout`` (TimeoutError).

    Not the loop's default executor: its threads are joined when the process exits, so one left
    waiting in the kernel on a dead mount would hold SIGTERM up; this thread is a daemon thread.
    """
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, exc: BaseException | None) -> None:
        if result.done():  # timed out and cancelled meanwhile
            return
        if exc is not None:
            result.set_exception(exc)
        else:
            result.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            value, exc = call(), None
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            value, exc = None, err
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=run, name="blockd-fuse-call", daemon=True).start()
    return await asyncio.wait_for(result, timeout)
