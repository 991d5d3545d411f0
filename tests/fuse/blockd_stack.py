"""Real ``blockd target`` + ``blockd initiator`` processes with a FUSE mount, for tests and benchmarks.

``Stack(workdir).start()`` writes a target TOML for one namespace on a free loopback port,
starts both daemons, connects (``blockctl connect``) and mounts (``blockctl mount``) the volume
at ``workdir/mnt``, so the namespace is ``stack.file`` (``mnt/ns1``). Everything goes through
the same CLI a user would type.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NQN = "nqn.2026-11.io.blockd:fuse"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


def mounted(path: str | Path) -> bool:
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


class Stack:
    def __init__(self, workdir: str | Path, size: int = 256 << 20, block_size: int = 512,
                 nr_io_queues: int = 4, queue_size: int = 128, ctrl_loss_tmo: float = 20.0,
                 log_level: str = "info", backing: str | Path | None = None,
                 attr_ttl: float | None = None, metrics: bool = False, pure: bool = False,
                 start_timeout: float = 20.0, target_settings: dict[str, bool] | None = None,
                 initiator_env: dict[str, str] | None = None) -> None:
        self.dir = Path(workdir)
        self.size = size
        self.block_size = block_size
        self.nr_io_queues = nr_io_queues
        self.queue_size = queue_size
        self.ctrl_loss_tmo = ctrl_loss_tmo
        self.log_level = log_level
        self.attr_ttl = attr_ttl
        """Seconds the kernel caches the mount's attributes (None: the daemon's default)."""
        self.pure = pure
        """Both daemons run the pure-Python data plane (BLOCKD_PURE=1), for a side-by-side benchmark."""
        self.start_timeout = start_timeout
        """Seconds a daemon may take to listen (the VM bed's TCG guest wants more)."""
        self.target_settings = target_settings or {}
        """The target's ``[target]`` settings (e.g. ``io_uring_queues``), for a benchmark."""
        self.initiator_env = initiator_env or {}
        """More environment of the initiator (e.g. ``BLOCKD_FUSE_BUSY_POLL_US``), for a benchmark."""
        self.port = free_port()
        self.backing = Path(backing) if backing else self.dir / "vol.img"
        self.socket = self.dir / "initiator.sock"
        self.target_socket = self.dir / "target.sock"
        """The target's control socket (its own, not the system's default path)."""
        self.metrics_ports = {"target": free_port(), "initiator": free_port()} if metrics else {}
        """Both daemons' Prometheus endpoints on loopback (``[metrics]`` in each one's TOML),
        when ``metrics``; scraped at ``metrics_url(daemon)``."""
        self.mnt = self.dir / "mnt"
        self.file = self.mnt / "ns1"
        self.target: subprocess.Popen | None = None
        self.initiator: subprocess.Popen | None = None

    # -- processes ------------------------------------------------------------------------------

    def metrics_url(self, daemon: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[daemon]}/metrics"

    def _metrics_table(self, daemon: str) -> str:
        port = self.metrics_ports.get(daemon)
        return f"[metrics]\nenabled = true\nport = {port}\n" if port else ""

    def write_config(self) -> Path:
        cfg = self.dir / "target.toml"
        cfg.write_text(f"""
{self._metrics_table("target")}
[logging]
level = "{self.log_level}"

[target]
{"".join(f"{k} = {str(v).lower()}{chr(10)}" for k, v in self.target_settings.items())}
[control]
socket = "{self.target_socket}"

[[port]]
transport = "tcp"
address = "127.0.0.1"
port = {self.port}

[[subsystem]]
nqn = "{NQN}"
serial = "BLOCKDFUSE0001"
model = "blockd fuse"
allow_any_host = true

[[subsystem.namespace]]
nsid = 1
path = "{self.backing}"
size = {self.size}
block_size = {self.block_size}
""")
        return cfg

    def start_target(self) -> None:
        cfg = self.dir / "target.toml"
        if not cfg.exists():
            self.write_config()
        log = open(self.dir / "target.log", "ab")
        self.target = subprocess.Popen([tool("blockd"), "target", "--config", str(cfg)],
                                       stdout=log, stderr=log, cwd=REPO, env=self._env())
        wait_tcp(self.port, self.target, self.start_timeout)

    def stop_target(self, sig: int = signal.SIGKILL) -> None:
        if self.target is not None and self.target.poll() is None:
            self.target.send_signal(sig)
            self.target.wait(10)
        self.target = None

    def start_initiator(self) -> None:
        log = open(self.dir / "initiator.log", "ab")
        env = self._env()
        if self.attr_ttl is not None:
            env["BLOCKD_FUSE_ATTR_TTL"] = str(self.attr_ttl)
        env.update(self.initiator_env)
        argv = [tool("blockd"), "initiator", "--socket", str(self.socket), "--log-level", self.log_level]
        if self.metrics_ports:
            cfg = self.dir / "initiator.toml"
            cfg.write_text(self._metrics_table("initiator"))
            argv += ["--config", str(cfg)]
        self.initiator = subprocess.Popen(argv,
                                          stdout=log, stderr=log, cwd=REPO, env=env)
        deadline = time.monotonic() + self.start_timeout
        while not self.socket.exists():
            if self.initiator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"initiator did not start:\n{self.log('initiator')}")
            time.sleep(0.05)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.pure:
            env["BLOCKD_PURE"] = "1"
        return env

    def blockctl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([tool("blockctl"), "--socket", str(self.socket), *args],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if check and proc.returncode:
            raise RuntimeError(f"blockctl {' '.join(args)} failed: {proc.stderr.strip()}\n{self.log('initiator')}")
        return proc

    def connect(self, name: str = "vol") -> None:
        self.blockctl("connect", "-a", "127.0.0.1", "-s", str(self.port), "-n", NQN, "--name", name,
                      "-i", str(self.nr_io_queues), "-Q", str(self.queue_size),
                      "-l", str(self.ctrl_loss_tmo))

    def mount(self, name: str = "vol") -> None:
        self.mnt.mkdir(exist_ok=True)
        self.blockctl("mount", name, str(self.mnt))

    def start(self) -> Stack:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_target()
        self.start_initiator()
        self.connect()
        self.mount()
        return self

    def stop(self) -> None:
        if self.initiator is not None and self.initiator.poll() is None:
            self.initiator.send_signal(signal.SIGTERM)
            try:
                self.initiator.wait(15)
            except subprocess.TimeoutExpired:
                self.initiator.kill()
                self.initiator.wait()
        self.initiator = None
        if mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], check=False)
        self.stop_target(signal.SIGTERM)

    def log(self, which: str, lines: int = 30) -> str:
        path = self.dir / f"{which}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_tcp(port: int, proc: subprocess.Popen | None = None, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.05)
