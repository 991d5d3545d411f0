"""Helpers for tests that run *inside* the VM (see tests/vm/conftest.py for how they get there)."""

from __future__ import annotations

import glob
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

IN_VM = os.environ.get("BLOCKD_VM") == "1"
REPO = Path(os.environ.get("BLOCKD_VM_REPO", Path(__file__).resolve().parents[3]))
GUEST = Path(os.environ.get("BLOCKD_VM_GUEST", REPO / "tests/vm/guest"))
RESULTS = Path(os.environ.get("BLOCKD_VM_RESULTS", "/tmp/blockd-vm-results"))
VENV_BIN = REPO / ".venv" / "bin"

ADDR0 = "192.0.2.1"   # veth0 / rxe0: target side
ADDR1 = "192.0.2.2"   # veth1 / rxe1: initiator side

_PRELUDE = (f". {shlex.quote(str(GUEST / 'nvmet-kernel.sh'))}; "
            f". {shlex.quote(str(GUEST / 'nvme-host.sh'))}; ")


def sh(script: str, *, check: bool = True, timeout: float = 180) -> str:
    """Run a bash snippet (guest helpers sourced, -e -o pipefail); echo and return its stdout.

    stderr is echoed too (pytest captures both into the JUnit report).  On a non-zero
    status (with ``check``) raises AssertionError carrying the output.
    """
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", "set -eo pipefail; " + _PRELUDE + script],
                       capture_output=True, text=True, timeout=timeout)
    dt = time.monotonic() - t0
    print(f"$ {script.strip()}\n[exit {r.returncode}, {dt:.1f}s]")
    if r.stdout:
        print(r.stdout, end="" if r.stdout.endswith("\n") else "\n")
    if r.stderr:
        print("[stderr]\n" + r.stderr, end="" if r.stderr.endswith("\n") else "\n")
    if check and r.returncode != 0:
        raise AssertionError(f"command failed with exit {r.returncode}: {script.strip()}\n"
                             f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    return r.stdout


def tool(name: str) -> str:
    """A project entry point (.venv/bin/NAME) or, failing that, NAME on PATH."""
    p = VENV_BIN / name
    return str(p) if p.exists() else name


def wait_tcp(addr: str, port: int, timeout: float = 60, proc: subprocess.Popen | None = None,
             what: str = "listener") -> None:
    """Wait until something accepts TCP connections on addr:port."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before listening on "
                                 f"{addr}:{port}")
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {addr}:{port} after {timeout}s") from None
            time.sleep(0.3)


def wait_path(path: str | Path, timeout: float = 60, proc: subprocess.Popen | None = None,
              what: str = "daemon") -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before creating {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear after {timeout}s")
        time.sleep(0.2)


class Daemon:
    """A background process whose stderr/stdout go to RESULTS/<name>.log; stopped on exit."""

    def __init__(self, name: str, argv: list[str]):
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = RESULTS / f"{name}.log"
        self._log = open(self.log_path, "w")
        print(f"starting {name}: {shlex.join(argv)} (log {self.log_path})")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 5) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        print(f"{self.name} stopped (exit {self.proc.returncode}); last log lines:\n"
              + self.log_tail())
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_target(name: str, config: Path, port: int = 4420) -> Daemon:
    """``blockd target --config CONFIG`` as daemon ``name``, returned once it accepts NVMe/TCP
    connections on ADDR0:``port``; when it does not, stopped, with its log tail in the error."""
    d = Daemon(name, [tool("blockd"), "target", "--config", str(config)])
    try:
        wait_tcp(ADDR0, port, timeout=120, proc=d.proc, what="blockd target")
    except AssertionError as e:
        d.stop()
        raise AssertionError(f"{e}\n--- blockd target log\n{d.log_tail()}") from None
    return d


def nvme_ctrl_of(nqn: str, port: int) -> str:
    """The kernel host's controller (nvmeX) of subsystem ``nqn`` connected to port ``port``."""
    for c in glob.glob("/sys/class/nvme-fabrics/ctl/nvme*"):
        if Path(c, "subsysnqn").read_text().strip() == nqn and f"trsvcid={port}" in Path(c, "address").read_text():
            return os.path.basename(c)
    raise AssertionError(f"no controller of {nqn} on port {port}")


def nvme_path_attr(nqn: str, port: int, name: str, nsid: int = 1) -> str:
    """An attribute (ana_state, ana_grpid) of the multipath path device of namespace ``nsid`` on the
    controller of ``nqn`` at ``port``."""
    ctrl = nvme_ctrl_of(nqn, port)
    paths = glob.glob(f"/sys/class/nvme/{ctrl}/nvme*c*n{nsid}/{name}")
    assert paths, f"{ctrl} has no path device (native multipath off?)"
    return Path(paths[0]).read_text().strip()
