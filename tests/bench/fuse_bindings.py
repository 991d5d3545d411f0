"""Which FUSE binding for ``blockctl mount``: the same RAM-backed 256 MiB file served by

* ``raw``: initiator/fuse/ (the kernel protocol on /dev/fuse, on the asyncio loop),
* ``mfusepy``: libfuse3 threads through ctypes, each request handed to an asyncio loop thread
  with ``run_coroutine_threadsafe`` (how the daemon's Controller would be reached),
* ``pyfuse3``: Cython low-level API run on asyncio (``pyfuse3.asyncio``), no thread hop,

all answering from an in-memory "controller" on an asyncio loop, so only the binding differs.
fio does 4 KiB O_DIRECT random reads, 1 and 4 jobs. Needs root, fio, and (for the last two)
``pip install mfusepy pyfuse3``. Run: ``python tests/bench/fuse_bindings.py [--runtime S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SIZE = 256 << 20
BS = 512


class RamController:
    """Just enough of initiator.controller.Controller for FuseMount: data in a bytearray."""

    def __init__(self) -> None:
        from initiator.controller import NamespaceInfo
        self.data = bytearray(os.urandom(1 << 20) * (SIZE >> 20))
        self.namespaces = {1: NamespaceInfo(1, SIZE // BS, BS, False)}
        self.failed = None

    async def read_into(self, nsid: int, slba: int, buf: memoryview) -> None:
        off = slba * BS
        buf[:] = self.data[off:off + len(buf)]

    async def write(self, nsid: int, slba: int, data: bytes, fua: bool = False) -> None:
        off = slba * BS
        self.data[off:off + len(data)] = data

    def hold_sends(self) -> None:
        pass

    def release_sends(self) -> None:
        pass

    def transfer(self, write: bool, nsid: int, offset: int, buf: memoryview, done, fua: bool = False) -> None:
        if write:
            self.data[offset:offset + len(buf)] = buf
        else:
            buf[:] = self.data[offset:offset + len(buf)]
        done(None)

    async def flush(self, nsid: int) -> None:
        pass


def serve_raw(mnt: str, ready: threading.Event, stop: threading.Event) -> None:
    from initiator.fuse import FuseMount

    async def main() -> None:
        mount = FuseMount({"ram": RamController()}, "ram", mnt)
        await mount.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await mount.stop(lazy=True)
    from blockd import eventloop
    eventloop.run(main())


def _loop_thread() -> tuple[asyncio.AbstractEventLoop, RamController]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop, asyncio.run_coroutine_threadsafe(_make(), loop).result()


async def _make() -> RamController:
    return RamController()


def serve_mfusepy(mnt: str, ready: threading.Event, stop: threading.Event) -> None:
    import mfusepy
    loop, ctrl = _loop_thread()

    class Ops(mfusepy.Operations):
        use_ns = True

        def getattr(self, path, fh=None):
            if path == "/":
                return dict(st_mode=stat.S_IFDIR | 0o755, st_nlink=2)
            if path == "/ns1":
                return dict(st_mode=stat.S_IFREG | 0o644, st_nlink=1, st_size=SIZE)
            raise mfusepy.FuseOSError(errno.ENOENT)

        def readdir(self, path, fh):
            return [".", "..", "ns1"]

        def open(self, path, flags):
            return 0

        def read(self, path, size, offset, fh):
            buf = bytearray(size)
            asyncio.run_coroutine_threadsafe(ctrl.read_into(1, offset // BS, memoryview(buf)), loop).result()
            return bytes(buf)

        def write(self, path, data, offset, fh):
            asyncio.run_coroutine_threadsafe(ctrl.write(1, offset // BS, data), loop).result()
            return len(data)

    ready.set()
    mfusepy.FUSE(Ops(), mnt, foreground=True, allow_other=True, direct_io=True)


def serve_pyfuse3(mnt: str, ready: threading.Event, stop: threading.Event) -> None:
    import pyfuse3
    import pyfuse3.asyncio
    pyfuse3.asyncio.enable()

    class Ops(pyfuse3.Operations):
        def __init__(self, ctrl: RamController) -> None:
            super().__init__()
            self.ctrl = ctrl

        async def getattr(self, inode, ctx=None):
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            if inode == pyfuse3.ROOT_INODE:
                a.st_mode, a.st_nlink = stat.S_IFDIR | 0o755, 2
            else:
                a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o644, 1, SIZE
            a.attr_timeout = a.entry_timeout = 60
            return a

        async def lookup(self, parent, name, ctx=None):
            if name != b"ns1":
                raise pyfuse3.FUSEError(errno.ENOENT)
            return await self.getattr(2)

        async def open(self, inode, flags, ctx):
            return pyfuse3.FileInfo(fh=inode, direct_io=bool(flags & os.O_DIRECT))

        async def read(self, fh, off, size):
            buf = bytearray(size)
            await self.ctrl.read_into(1, off // BS, memoryview(buf))
            return bytes(buf)

        async def write(self, fh, off, buf):
            await self.ctrl.write(1, off // BS, buf)
            return len(buf)

    async def main() -> None:
        ops = Ops(RamController())
        opts = set(pyfuse3.default_options) | {"allow_other"}
        pyfuse3.init(ops, mnt, opts)
        ready.set()
        task = asyncio.ensure_future(pyfuse3.main())
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.1)
        pyfuse3.close(unmount=True)
    asyncio.run(main())


SERVERS = {"raw": serve_raw, "mfusepy": serve_mfusepy, "pyfuse3": serve_pyfuse3}


def fio(path: str, numjobs: int, runtime: int) -> tuple[float, float]:
    out = subprocess.run(["fio", "--output-format=json", "--name=r", f"--filename={path}", "--direct=1",
                          "--rw=randread", "--bs=4k", "--ioengine=psync", f"--numjobs={numjobs}",
                          "--group_reporting", "--time_based", f"--runtime={runtime}", f"--size={SIZE}"],
                         capture_output=True, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]["read"]
    return job["iops"], job["clat_ns"]["percentile"]["99.000000"] / 1000


def child(binding: str, mnt: str, runtime: int) -> None:
    """Serve in this process (threads), run fio from it, print one JSON line."""
    ready, stop = threading.Event(), threading.Event()
    th = threading.Thread(target=SERVERS[binding], args=(mnt, ready, stop), daemon=True)
    th.start()
    ready.wait(10)
    for _ in range(100):
        if os.path.exists(os.path.join(mnt, "ns1")):
            break
        time.sleep(0.05)
    with open("/proc/mounts") as f:
        if not any(line.split()[1] == os.path.realpath(mnt) for line in f):
            sys.exit(f"{binding}: {mnt} is not mounted")
    res = {}
    for n in (1, 4):
        t0 = os.times()
        iops, p99 = fio(os.path.join(mnt, "ns1"), n, runtime)
        t1 = os.times()
        cpu = (t1.user + t1.system - t0.user - t0.system) / (iops * runtime) * 1e6
        res[n] = (iops, p99, cpu)
    stop.set()
    if binding == "mfusepy":
        subprocess.run(["umount", "-l", mnt], check=False)
    th.join(5)
    print(json.dumps({"binding": binding, **{str(k): v for k, v in res.items()}}))
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mnt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.mnt, args.runtime)
        return
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for binding in SERVERS:
            with tempfile.TemporaryDirectory() as mnt:
                proc = subprocess.run([sys.executable, __file__, "--child", binding, "--mnt", mnt,
                                       "--runtime", str(args.runtime)], capture_output=True, text=True,
                                      timeout=args.runtime * 4 + 60)
                subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if not line:
                    print(f"{binding}: failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
                    continue
                results.setdefault(binding, []).append(json.loads(line[-1]))
    print(f"{'binding':<10} {'QD1 IOPS':>10} {'p99 us':>8} {'CPU us/IO':>10} {'4 jobs IOPS':>12} {'p99 us':>8}"
          f" {'CPU us/IO':>10}   (best of rounds; CPU = the FUSE server process)")
    for binding, runs in results.items():
        one = max(runs, key=lambda r: r["1"][0])["1"]
        four = max(runs, key=lambda r: r["4"][0])["4"]
        print(f"{binding:<10} {one[0]:>10.0f} {one[1]:>8.0f} {one[2]:>10.1f} {four[0]:>12.0f} {four[1]:>8.0f}"
              f" {four[2]:>10.1f}")


if __name__ == "__main__":
    main()
