"""A single-node Ceph cluster for the RBD tests and benchmarks: one mon, an optional mgr and one
memstore OSD on 127.0.0.1, all under one temporary folder, from Debian's packages.

The sequence is the one tried for issue 37 on this project's machine kind (go-ceph's CI starts
Ceph the same way with its micro-osd script): cephx off, pool size 1, the two paxos intervals
shortened (start-up 8 s -> about 1 s), every daemon in the foreground as a child of this
process so that stopping it is a ``terminate``/``wait`` in reverse order (the OSD before the
mon, or the OSD waits 5 s for the mon's ack). ``osd client watch timeout`` is lowered so that a
gateway that stops (SIGSTOP, kill -9) loses its watch on the image within seconds: the rbd
backend's failover reads the watchers (docs/ceph.md).

As a command, for benchmarks and by-hand runs (Ctrl-C or SIGTERM stops it)::

    python -m tests.ceph.cluster /tmp/ceph [--image vol1 --size 1GiB] [--mgr]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("ceph-mon", "ceph-osd", "ceph", "rbd")
"""The programs the cluster needs (ceph-mgr only with ``mgr=True``)."""
SEARCH_PATH = os.environ.get("BLOCKD_CEPH_PATH")
"""Where the programs are looked for (a PATH); unset: the PATH. The CI rule's test points it at
nothing."""
WATCH_TIMEOUT = 3
"""Seconds after which the OSD drops the watch of a client that stopped pinging (Ceph's default
is 30): how soon a standby gateway sees that the active one is gone."""
START_TIMEOUT = 60.0

_CONF = """\
[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{port}
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon data avail crit = 0
mon data avail warn = 1
mon warn on pool no redundancy = false
paxos propose interval = 0.05
paxos min wait = 0.01
osd client watch timeout = {watch_timeout}
run dir = {dir}/run
admin socket = {dir}/run/$cluster-$name.$pid.asok
log file = {dir}/log/$name.log
mon cluster log file = {dir}/log/cluster.log
[mon.a]
mon data = {dir}/mon
[mgr.x]
mgr data = {dir}/mgr
[osd.0]
osd data = {dir}/osd
osd objectstore = memstore
memstore device bytes = {store_bytes}
"""


def missing_programs(mgr: bool = False) -> list[str]:
    """The cluster's programs not found on PATH (empty: it can start)."""
    return [p for p in DAEMONS + (("ceph-mgr",) if mgr else ()) if shutil.which(p, path=SEARCH_PATH) is None]


def _argv(args: tuple[str, ...]) -> tuple[str, ...]:
    return (shutil.which(args[0], path=SEARCH_PATH) or args[0], *args[1:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running cluster: its folder, ``ceph.conf``, pool and daemons (started by :meth:`start`)."""

    dir: Path
    pool: str = "rbd"
    mgr: bool = False
    store_bytes: int = 2 << 30
    watch_timeout: int = WATCH_TIMEOUT
    """``osd client watch timeout``; a slow guest (qemu TCG) needs more, or a gateway's own watch
    lapses between its pings."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    start_seconds: float = 0.0
    """Wall time from nothing to the pool initialised."""

    @property
    def conf(self) -> Path:
        return self.dir / "ceph.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "CEPH_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = START_TIMEOUT) -> str:
        """A ``ceph``/``rbd`` command against this cluster; its stdout. Raises with its stderr."""
        done = subprocess.run(_argv(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        return done.stdout

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(_argv((*args, "-f")), env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def start(self) -> "Cluster":
        """Make the folder and the daemons, the pool ``pool`` initialised for RBD."""
        t0 = time.monotonic()
        for sub in ("mon", "mgr", "osd", "run", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_CONF.format(fsid=uuid.uuid4(), port=_free_port(), dir=self.dir,
                                          watch_timeout=self.watch_timeout, store_bytes=self.store_bytes))
        try:
            self.run("ceph-mon", "--id", "a", "--mkfs", "--keyring", "/dev/null")
            (self.dir / "mon" / "keyring").touch()
            self._daemon("mon", "ceph-mon", "--id", "a")
            if self.mgr:
                self._daemon("mgr", "ceph-mgr", "--id", "x")
            osd = self.run("ceph", "osd", "create").strip()
            self.run("ceph", "osd", "crush", "add", f"osd.{osd}", "1", "root=default", "host=localhost")
            self.run("ceph-osd", "--id", osd, "--mkfs")
            self._daemon("osd", "ceph-osd", "--id", osd)
            deadline = time.monotonic() + START_TIMEOUT
            while '"num_up_osds":1' not in self.run("ceph", "osd", "stat", "-f", "json"):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError("the OSD did not come up")
                time.sleep(0.1)
            self.run("ceph", "osd", "pool", "create", self.pool, "8")
            self.run("rbd", "pool", "init", self.pool)
        except BaseException:
            self.stop(keep=True)
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                out = (self.dir / "log" / f"{name}.out").read_text(errors="replace")[-500:]
                raise RuntimeError(f"ceph {name} exited ({p.returncode}): {out}")

    def rss_kib(self) -> dict[str, int]:
        """Each daemon's resident set (VmRSS), KiB."""
        result = {}
        for name, p in self.procs.items():
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    result[name] = int(line.split()[1])
        return result

    def create_image(self, name: str, size: int) -> None:
        self.run("rbd", "create", f"{self.pool}/{name}", "--size", f"{size}B")

    def stop(self, keep: bool = False) -> None:
        """Stop the daemons (OSD first), then remove the folder unless ``keep``."""
        for name in ("osd", "mgr", "mon"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description="a single-node Ceph cluster in a folder, until SIGTERM/Ctrl-C")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--mgr", action="store_true", help="also start ceph-mgr (not needed for RBD I/O)")
    ap.add_argument("--image", action="append", default=[], help="an RBD image to create in pool rbd")
    ap.add_argument("--size", default="1073741824", help="image size in bytes (default 1 GiB)")
    args = ap.parse_args()
    cluster = Cluster(args.dir.resolve(), mgr=args.mgr).start()
    for image in args.image:
        cluster.create_image(image, int(args.size))
    print(f"CEPH_CONF={cluster.conf} started in {cluster.start_seconds:.2f} s; RSS KiB {cluster.rss_kib()}",
          flush=True)
    def stop(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
