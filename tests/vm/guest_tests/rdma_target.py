"""A blockd NVMe/RDMA target in one process, for the VM tests (until `blockd target --config`
knows rdma ports): ``python -m tests.vm.guest_tests.rdma_target ADDR PORT NQN FILE SIZE``.

Also usable in-process: ``async with serve(addr, port, nqn, path, size) as (target, listener)``.
Prints ``READY`` on stdout once listening; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys


def build_target(nqn: str, path: str, size: int, block_size: int = 512, serial: str = "BLOCKDRDMA01",
                 limits=None):
    from target.backend import FileBackend
    from target.config import Limits
    from target.subsystem import Namespace, Subsystem
    from target.target import Target
    t = Target(limits=limits or Limits())
    sub = Subsystem(nqn, serial=serial, model="blockd", allow_any_host=True)
    t.add_subsystem(sub)
    t.add_namespace(sub, Namespace(1, FileBackend(path, size), block_size=block_size,
                                   subsystem_nqn=nqn, path=path))
    return t


@contextlib.asynccontextmanager
async def serve(addr: str, port: int, nqn: str, path: str, size: int, limits=None):
    from target.rdma import RdmaListener
    from target.target import PortInfo
    t = build_target(nqn, path, size, limits=limits)
    info = PortInfo(1, "rdma", addr, str(port))
    t.add_port(info)
    lst = RdmaListener(t, info)
    await lst.start()
    try:
        yield t, lst
    finally:
        await lst.stop()
        await t.close()


async def _main(addr: str, port: int, nqn: str, path: str, size: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(addr, port, nqn, path, size):
        print("READY", flush=True)
        await stop.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
    a = sys.argv[1:]
    asyncio.run(_main(a[0], int(a[1]), a[2], a[3], int(a[4])))
