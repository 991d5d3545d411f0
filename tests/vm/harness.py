"""blockd's VM test bed: run a command inside a throw-away qemu VM whose kernel has
Soft-RoCE (rdma_rxe), the NVMe-oF host and target (tcp and rdma) and configfs.

The host kernel of our dev/CI machines has none of that (and KVM hangs there), so we boot
Debian's stock kernel package under qemu TCG.  The guest uses the host's own userland: the
host's ``/`` is shared read-only over 9p with a tmpfs overlay on top, so the repository, its
``.venv`` and every host binary (nvme-cli, fio, perftest, iproute2, ...) work unchanged.
Whatever the guest writes is lost at power-off, except in folders shared read-write.

    python -m tests.vm.harness run [-t SECS] [-w DIR] [-e VAR=VAL] [-l LOG] -- CMD...
    python -m tests.vm.harness run -c 'shell snippet'
    python -m tests.vm.harness shell          # interactive bash on the serial console
    python -m tests.vm.harness setup          # fetch kernel + build initramfs only

Exit status of ``run``: the guest command's; 124 timeout; 125 the VM failed.

Cache (outside the repository): ``$BLOCKD_VM_CACHE`` or ``~/.cache/blockd-vm``:
``kernel/<pkg>/`` (unpacked kernel package, depmod'ed) and ``initrd-<kver>-<hash>.gz``.
Other knobs: ``BLOCKD_VM_KERNEL_PKG`` (e.g. linux-image-6.1.0-57-amd64), ``BLOCKD_VM_AUTH_KERNEL_PKG``
(the kernel of the groups that need NVMe in-band authentication, :func:`auth_kernel_pkg`), ``BLOCKD_VM_QEMU``,
``BLOCKD_VM_BUSYBOX``, ``BLOCKD_VM_MEM`` (MiB), ``BLOCKD_VM_SMP``, ``BLOCKD_VM_APPEND``.

In the guest the command runs as root in the given directory (default: the repository
root) with ``BLOCKD_VM=1``, ``BLOCKD_VM_GUEST=<repo>/tests/vm/guest`` (shell helpers),
``<repo>/.venv/bin`` first on ``PATH`` and the repository on ``PYTHONPATH``, and the host's
``BLOCKD_PURE`` if set (:data:`GUEST_ENV_FROM_HOST`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import gzip
import lzma
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INIT_SCRIPT = HERE / "init"
GUEST_DIR = HERE / "guest"
# modules the initramfs needs to reach the host root; dependencies are resolved by modprobe
INITRD_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GUEST_ENV_FROM_HOST = ("BLOCKD_PURE",)
"""Host variables the guest command inherits: the guest boots with a clean environment, so
without this a ``BLOCKD_PURE=1`` VM run silently tested the compiled data plane in the guest."""

# every qemu we started and have not reaped yet; killed at interpreter exit at the latest
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


class VMError(RuntimeError):
    """The bed cannot be set up (missing tool, kernel download failed, ...)."""


def log(msg: str) -> None:
    print(f"blockd-vm: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ checks ---
def qemu_binary() -> str:
    return os.environ.get("BLOCKD_VM_QEMU", "qemu-system-x86_64")


def missing_tools() -> list[str]:
    """Host tools the bed needs that are not installed (empty: the bed can run)."""
    need = [qemu_binary(), "cpio", "depmod", "modprobe", "dpkg-deb", "apt-get"]
    out = [t for t in need if shutil.which(t) is None]
    bb = busybox_binary()
    if not (os.path.isfile(bb) and os.access(bb, os.X_OK)):
        out.append(f"{bb} (busybox-static)")
    return out


def busybox_binary() -> str:
    return os.environ.get("BLOCKD_VM_BUSYBOX", "/bin/busybox")


def skip_reason() -> str | None:
    """Why VM tests cannot run here, or None."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "the VM test bed needs an x86_64 Linux host"
    miss = missing_tools()
    if miss:
        return ("VM test bed unavailable: missing " + ", ".join(miss)
                + " (run scripts/setup.sh as root: it installs qemu-system-x86 busybox-static cpio kmod)")
    return None


# ------------------------------------------------------------------------------- cache ---
def cache_dir() -> Path:
    env = os.environ.get("BLOCKD_VM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockd-vm"


@contextlib.contextmanager
def _cache_lock():
    """One process at a time fetches the kernel / builds the initramfs."""
    c = cache_dir()
    c.mkdir(parents=True, exist_ok=True)
    with open(c / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Kernel:
    pkg: str
    root: Path      # unpacked package
    version: str    # e.g. 6.1.0-57-amd64

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def _kernel_pkg_from_apt() -> str | None:
    r = subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                       capture_output=True, text=True)
    m = re.search(r"^\s*Depends:\s*(linux-image-[0-9]\S*-amd64)\s*$", r.stdout, re.M)
    return m.group(1) if m else None


def _pick_kernel_pkg() -> str:
    pkg = os.environ.get("BLOCKD_VM_KERNEL_PKG")
    if pkg:
        return pkg
    cur = cache_dir() / "kernel" / "current"
    if cur.is_symlink() and (cur.resolve() / ".complete").exists():
        return os.readlink(cur)
    pkg = _kernel_pkg_from_apt()
    if not pkg and os.geteuid() == 0:
        log("apt-get update (to find the kernel package)")
        subprocess.run(["apt-get", "update", "-qq"], stdout=sys.stderr)
        pkg = _kernel_pkg_from_apt()
    if not pkg:
        raise VMError("cannot tell which kernel package linux-image-amd64 depends on; "
                      "set BLOCKD_VM_KERNEL_PKG=linux-image-<ver>-amd64")
    return pkg


AUTH_KERNEL_PKG = re.compile(r"^linux-image-6\.12\.(\d+)\+deb12-amd64-unsigned$")
"""Bookworm's default 6.1 kernel lacks NVMe in-band authentication (# CONFIG_NVME_AUTH is not
set); its security updates carry 6.12 kernels built with CONFIG_NVME_AUTH,
CONFIG_NVME_HOST_AUTH and CONFIG_NVME_TARGET_AUTH."""


def auth_kernel_pkg() -> str:
    """The kernel package for groups that need DH-HMAC-CHAP in the kernel: a cached one, else
    the newest bookworm 6.12 package apt knows (``BLOCKD_VM_AUTH_KERNEL_PKG`` overrides)."""
    pkg = os.environ.get("BLOCKD_VM_AUTH_KERNEL_PKG")
    if pkg:
        return pkg
    cached = [d.name for d in (cache_dir() / "kernel").glob("linux-image-6.12.*")
              if AUTH_KERNEL_PKG.match(d.name) and (d / ".complete").exists()]
    if not cached:
        r = subprocess.run(["apt-cache", "pkgnames", "linux-image-6.12."],
                           capture_output=True, text=True)
        cached = [n for n in r.stdout.split() if AUTH_KERNEL_PKG.match(n)]
    if not cached:
        raise VMError("no linux-image-6.12.*+deb12-amd64-unsigned package known to apt "
                      "(bookworm-security in sources.list, apt-get update?); or set "
                      "BLOCKD_VM_AUTH_KERNEL_PKG")
    return max(cached, key=lambda n: int(AUTH_KERNEL_PKG.match(n).group(1)))


def _download_deb(pkg: str, dest: Path) -> Path:
    # a copy apt already has (e.g. from an earlier `apt-get install --download-only`)
    arch = sorted(Path("/var/cache/apt/archives").glob(f"{pkg}_*_amd64.deb"))
    if arch:
        shutil.copy(arch[-1], dest)
        return dest / arch[-1].name
    # as root apt downloads as user _apt, who may not enter the cache dir
    opts = ["-o", "APT::Sandbox::User=root"] if os.geteuid() == 0 else []
    for attempt in (1, 2):
        r = subprocess.run(["apt-get", *opts, "download", pkg], cwd=dest, stdout=sys.stderr)
        if r.returncode == 0:
            break
        if attempt == 1 and os.geteuid() == 0:
            log("apt-get download failed; apt-get update and retry")
            subprocess.run(["apt-get", "update", "-qq"], stdout=sys.stderr)
            continue
        raise VMError(f"apt-get download {pkg} failed")
    debs = list(dest.glob("*.deb"))
    if len(debs) != 1:
        raise VMError(f"apt-get download {pkg}: expected one .deb, found {debs}")
    return debs[0]


def ensure_kernel(pkg: str | None = None) -> Kernel:
    """The kernel package ``pkg`` (default: the bed's usual one) unpacked (and depmod'ed) in the
    cache; fetched on first use. Each package keeps its own directory, so groups on different
    kernels share the cache; only the default moves the ``current`` link."""
    default = pkg is None
    with _cache_lock():
        pkg = pkg or _pick_kernel_pkg()
        kroot = cache_dir() / "kernel" / pkg
        if not (kroot / ".complete").exists():
            for t in ("apt-get", "dpkg-deb", "depmod"):
                if shutil.which(t) is None:
                    raise VMError(f"{t} is needed to fetch the kernel")
            log(f"fetching {pkg} into {kroot}")
            kroot.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".fetch.", dir=kroot.parent))
            try:
                deb = _download_deb(pkg, tmp)
                _run(["dpkg-deb", "-x", str(deb), str(tmp / "root")])
                kvers = os.listdir(tmp / "root/lib/modules")
                if len(kvers) != 1:
                    raise VMError(f"{pkg}: expected one module tree, found {kvers}")
                _run(["depmod", "-b", str(tmp / "root"), kvers[0]])
                shutil.rmtree(kroot, ignore_errors=True)
                (tmp / "root").rename(kroot)
                (kroot / ".complete").touch()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        cur = cache_dir() / "kernel" / "current"
        if default and (not cur.is_symlink() or os.readlink(cur) != pkg):
            tmpl = cur.with_name(".current.tmp")
            with contextlib.suppress(FileNotFoundError):
                tmpl.unlink()
            tmpl.symlink_to(pkg)
            tmpl.replace(cur)
    kver = sorted(os.listdir(kroot / "lib/modules"))[0]
    k = Kernel(pkg, kroot, kver)
    if not k.vmlinuz.is_file():
        raise VMError(f"no kernel image at {k.vmlinuz}")
    return k


def _initrd_modules(k: Kernel) -> list[str]:
    """Paths of the .ko files for INITRD_MODULES with their dependencies, in load order."""
    r = subprocess.run(["modprobe", "-d", str(k.root), "-S", k.version, "--show-depends",
                        "-a", *INITRD_MODULES], capture_output=True, text=True)
    if r.returncode != 0:
        raise VMError(f"modprobe --show-depends failed: {r.stderr.strip()}")
    out: list[str] = []
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0] == "insmod" and f[1] not in out:
            out.append(f[1])
    return out


def ensure_initrd(k: Kernel) -> Path:
    """A busybox initramfs with tests/vm/init and the modules needed to mount the host root."""
    import hashlib

    bb = busybox_binary()
    if subprocess.run(["ldd", bb], capture_output=True).returncode == 0:
        raise VMError(f"{bb} is dynamically linked; install busybox-static or set BLOCKD_VM_BUSYBOX")
    mods = _initrd_modules(k)
    h = hashlib.sha256()
    h.update(INIT_SCRIPT.read_bytes())
    h.update(Path(bb).read_bytes())
    h.update((k.version + " " + " ".join(mods)).encode())
    path = cache_dir() / f"initrd-{k.version}-{h.hexdigest()[:12]}.gz"
    with _cache_lock():
        if path.exists():
            return path
        log(f"building {path}")
        with tempfile.TemporaryDirectory(prefix="blockd-vm-initrd.") as st:
            s = Path(st)
            for d in ("bin", "sbin", "dev", "proc", "sys", "host", "upper", "newroot", "mods"):
                (s / d).mkdir()
            shutil.copy(bb, s / "bin/busybox")
            shutil.copy(INIT_SCRIPT, s / "init")
            os.chmod(s / "init", 0o755)
            order = []
            for ko in mods:
                name = os.path.basename(ko)
                data = Path(ko).read_bytes()
                if name.endswith(".xz"):
                    data, name = lzma.decompress(data), name[:-3]
                elif name.endswith(".zst"):
                    data = subprocess.run(["zstd", "-qdc", ko], check=True,
                                          capture_output=True).stdout
                    name = name[:-4]
                elif name.endswith(".gz"):
                    data, name = gzip.decompress(data), name[:-3]
                (s / "mods" / name).write_bytes(data)
                order.append(name)
            (s / "mods/order").write_text("".join(n + "\n" for n in order))
            files = subprocess.run(["find", "."], cwd=s, check=True, capture_output=True).stdout
            cpio = subprocess.run(["cpio", "-o", "-H", "newc", "-R", "0:0", "--quiet"], cwd=s,
                                  input=files, check=True, capture_output=True).stdout
            tmp = path.with_suffix(".tmp")
            with gzip.open(tmp, "wb", compresslevel=6) as f:
                f.write(cpio)
            tmp.replace(path)
        for old in cache_dir().glob(f"initrd-{k.version}-*.gz"):
            if old != path:
                old.unlink(missing_ok=True)
    return path


def ensure_assets(kernel_pkg: str | None = None) -> tuple[Kernel, Path]:
    miss = missing_tools()
    if miss:
        raise VMError("missing " + ", ".join(miss))
    k = ensure_kernel(kernel_pkg)
    return k, ensure_initrd(k)


# --------------------------------------------------------------------------------- run ---
@dataclass
class VMResult:
    rc: int                  # the guest command's status; 124 timeout; 125 VM failure
    log_path: Path | None    # console output (CRs removed)
    wall: float              # seconds from qemu start to qemu exit
    t_start: float | None    # guest uptime when the command started (≈ boot time)
    t_end: float | None      # guest uptime when the command ended
    timed_out: bool = False
    qemu_rc: int | None = None
    console: str = field(default="", repr=False)   # the console text (also in log_path)

    def summary(self) -> str:
        ts = f"{self.t_start:.1f}s" if self.t_start is not None else "?"
        te = f"{self.t_end:.1f}s" if self.t_end is not None else "?"
        return (f"exit {self.rc}{' (timeout)' if self.timed_out else ''}; guest uptime at "
                f"command start {ts}, at end {te}; wall {self.wall:.1f}s")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.console.splitlines()[-n:])


def _pdeathsig() -> None:
    """In the child before exec: die with SIGKILL when the parent (pytest, the CLI) dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # if the parent is already gone, the signal above will never come
    if os.getppid() == 1:
        os._exit(1)


def _kill(proc: subprocess.Popen, grace: float = 3.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def kill_all() -> None:
    """Kill every VM this process started that still runs."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        _kill(p, grace=1.0)


import atexit  # noqa: E402

atexit.register(kill_all)


def _virtfs_path(p: str | Path) -> str:
    return str(p).replace(",", ",,")


def _write_control(ctl: Path, cmd, *, cwd: Path, env: dict[str, str], rw: list[Path],
                   interactive: bool) -> list[str]:
    venv_bin = REPO / ".venv" / "bin"
    lines = [
        "#!/bin/bash",
        f"export PATH={shlex.quote(str(venv_bin) + ':' + GUEST_PATH)}",
        "export HOME=/root LANG=C.UTF-8 BLOCKD_VM=1",
        f"export TERM={shlex.quote(os.environ.get('TERM', 'dumb') if interactive else 'dumb')}",
        f"export BLOCKD_VM_REPO={shlex.quote(str(REPO))} "
        f"BLOCKD_VM_GUEST={shlex.quote(str(GUEST_DIR))}",
        f"export PYTHONPATH={shlex.quote(str(REPO))}",
    ]
    if (venv_bin / "python").exists():
        lines.append(f"export VIRTUAL_ENV={shlex.quote(str(REPO / '.venv'))}")
    for k, v in {**{k: os.environ[k] for k in GUEST_ENV_FROM_HOST if k in os.environ}, **env}.items():
        lines.append(f"export {k}={shlex.quote(v)}")
    lines.append(f"cd {shlex.quote(str(cwd))} 2>/dev/null || cd /")
    if isinstance(cmd, str):
        lines.append(f"exec bash -c {shlex.quote(cmd)}")
    else:
        lines.append("exec " + " ".join(shlex.quote(str(c)) for c in cmd))
    (ctl / "cmd").write_text("\n".join(lines) + "\n")
    qargs: list[str] = []
    with open(ctl / "mounts", "w") as f:
        for i, d in enumerate(rw):
            f.write(f"rw{i} rw {d}\n")
            qargs += ["-virtfs", f"local,path={_virtfs_path(d)},mount_tag=rw{i},security_model=none"]
    if interactive:
        (ctl / "interactive").touch()
    return qargs


def _read_float(p: Path) -> float | None:
    try:
        return float(p.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# systemd mode: the command as a oneshot service of a target that the guest boots into
# (systemd.unit=blockd-vm.target), so the host's enabled multi-user units do not start
_SYSTEMD_SERVICE = """[Unit]
Description=blockd VM test bed command
After=basic.target

[Service]
Type=oneshot
StandardInput=null
StandardOutput=tty
StandardError=tty
TTYPath=/dev/console
TimeoutStartSec=infinity
ExecStartPre=/bin/sh -c 'cut -d" " -f1 /proc/uptime >/run/blockd-vm/t_start'
ExecStart=/bin/bash /run/blockd-vm/cmd
ExecStopPost=/bin/sh -c 'cut -d" " -f1 /proc/uptime >/run/blockd-vm/t_end; echo "$${EXIT_STATUS:-125}" >/run/blockd-vm/rc; sync; systemctl --force --force poweroff'
"""
_SYSTEMD_TARGET = """[Unit]
Description=blockd VM test bed
Requires=basic.target
After=basic.target
Wants=blockd-vm.service
AllowIsolate=yes
"""
# units masked in systemd mode: binfmt_misc hangs the boot; timers would start apt & co.
# (masking systemd-udev-trigger.service, which costs ~50 s of module loading under TCG, made
# the boot hang after journald: not done.)  BLOCKD_VM_SYSTEMD_MASKS="..." replaces the list.
SYSTEMD_MASKS = ("systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "timers.target")


def _write_systemd_control(ctl: Path) -> str:
    (ctl / "mode").write_text("systemd\n")
    (ctl / "blockd-vm.service").write_text(_SYSTEMD_SERVICE)
    (ctl / "blockd-vm.target").write_text(_SYSTEMD_TARGET)
    masks = os.environ.get("BLOCKD_VM_SYSTEMD_MASKS")
    names = masks.split() if masks is not None else SYSTEMD_MASKS
    return " systemd.unit=blockd-vm.target systemd.show_status=0 " + " ".join(
        f"systemd.mask={m}" for m in names)


_POWER_DOWN = re.compile(r"^\[ *[0-9.]+\] reboot: Power down$")


def run(cmd, *, rw: list[str | Path] = (), env: dict[str, str] | None = None,
        timeout: float | None = None, log_path: str | Path | None = None, echo: bool = False,
        cwd: str | Path | None = None, mem: int | None = None, smp: int | None = None,
        verbose: bool = False, interactive: bool = False, systemd: bool = False,
        kernel_pkg: str | None = None) -> VMResult:
    """Boot a VM, run ``cmd`` (an argv list, or a str for ``bash -c``) and power off.

    ``rw``: host folders shared read-write at the same path.  The VM is killed after
    ``timeout`` seconds (rc 124) and, in any case, before this function returns or raises
    (KeyboardInterrupt included); if this process dies, the kernel kills qemu (PDEATHSIG).
    ``systemd``: boot the host's systemd as PID 1 and run ``cmd`` as a oneshot service
    (slow: ~1 min more boot under TCG; see docs/vm-testbed.md). ``kernel_pkg``: boot that
    kernel package instead of the default (:func:`auth_kernel_pkg`).
    """
    kernel, initrd = ensure_assets(kernel_pkg)
    mem = mem or int(os.environ.get("BLOCKD_VM_MEM", "2048"))
    smp = smp or int(os.environ.get("BLOCKD_VM_SMP", "2"))
    rw_dirs = []
    for d in rw:
        p = Path(d).resolve()
        if not p.is_dir():
            raise VMError(f"not a directory: {d}")
        rw_dirs.append(p)
    cwd = Path(cwd).resolve() if cwd else REPO

    with tempfile.TemporaryDirectory(prefix="blockd-vm-run.") as ctl_s:
        ctl = Path(ctl_s)
        qargs = _write_control(ctl, cmd, cwd=cwd, env=dict(env or {}), rw=rw_dirs,
                               interactive=interactive)
        # TSC as the guest's clock, as on real hardware: under TCG the kernel otherwise picks HPET,
        # where every clock_gettime is a system call plus an emulated MMIO read (read_hpet was 5.3 %
        # of all guest samples of a 4 KiB QD1 read; docs/vm-testbed.md, "Clock"). QEMU's TCG TSC
        # follows the host's monotonic clock on every vCPU, so it is safe to trust here.
        append = "console=ttyS0 panic=-1 clocksource=tsc tsc=reliable"
        if not verbose:
            append += " quiet loglevel=3"
        if systemd:
            append += _write_systemd_control(ctl)
        append += " " + os.environ.get("BLOCKD_VM_APPEND", "")
        serial = (["-chardev", "stdio,id=con0,signal=off", "-serial", "chardev:con0"]
                  if interactive else ["-serial", "stdio"])
        q = [qemu_binary(), "-accel", "tcg", "-cpu", "max", "-m", str(mem), "-smp", str(smp),
             "-nodefaults", "-no-user-config", "-display", "none", "-nic", "none",
             *serial, "-no-reboot", "-pidfile", str(ctl / "qemu.pid"),
             "-kernel", str(kernel.vmlinuz), "-initrd", str(initrd), "-append", append.strip(),
             "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                        "multidevs=remap",
             "-virtfs", f"local,path={_virtfs_path(kernel.modules)},mount_tag=kmods,"
                        "security_model=none,readonly=on",
             "-virtfs", f"local,path={_virtfs_path(ctl)},mount_tag=blockd_ctl,security_model=none",
             *qargs]
        if verbose:
            log(shlex.join(q))

        t0 = time.monotonic()
        logf = open(log_path, "w") if log_path else None
        chunks: list[str] = []
        timed_out = False
        proc = None
        try:
            if interactive:
                proc = subprocess.Popen(q, preexec_fn=_pdeathsig)
                with _LIVE_LOCK:
                    _LIVE.add(proc)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
            else:
                proc = subprocess.Popen(q, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_pdeathsig)
                with _LIVE_LOCK:
                    _LIVE.add(proc)

                def pump():
                    for raw in iter(proc.stdout.readline, b""):
                        line = raw.decode("utf-8", "replace").replace("\r", "")
                        if _POWER_DOWN.match(line.rstrip("\n")):
                            continue
                        chunks.append(line)
                        if logf:
                            logf.write(line)
                            logf.flush()
                        if echo:
                            sys.stdout.write(line)
                            sys.stdout.flush()

                reader = threading.Thread(target=pump, daemon=True)
                reader.start()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    msg = f"\nblockd-vm: timed out after {timeout}s, killing the VM\n"
                    chunks.append(msg)
                    if logf:
                        logf.write(msg)
                _kill(proc)
                reader.join(5)
        finally:
            if proc is not None:
                _kill(proc)
            if logf:
                logf.close()
        wall = time.monotonic() - t0

        rc_text = (ctl / "rc").read_text().strip() if (ctl / "rc").exists() else ""
        if rc_text.isdigit() and not timed_out:
            rc = int(rc_text)
        elif timed_out:
            rc = 124
        else:
            rc = 125
        return VMResult(rc=rc, log_path=Path(log_path) if log_path else None, wall=wall,
                        t_start=_read_float(ctl / "t_start"), t_end=_read_float(ctl / "t_end"),
                        timed_out=timed_out, qemu_rc=proc.returncode if proc else None,
                        console="".join(chunks))


# --------------------------------------------------------------------------------- CLI ---
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.vm.harness",
                                 description="Run a command in blockd's qemu test bed (Debian "
                                             "kernel with rxe + NVMe-oF, host root read-only).")
    sub = ap.add_subparsers(dest="sub", required=True)

    def common(p):
        p.add_argument("-w", "--rw", action="append", default=[], metavar="DIR",
                       help="share host DIR read-write at the same path (repeatable)")
        p.add_argument("-e", "--env", action="append", default=[], metavar="VAR=VAL")
        p.add_argument("-t", "--timeout", type=float, default=None, metavar="SECS",
                       help="kill the VM after SECS (exit 124)")
        p.add_argument("-m", "--mem", type=int, default=None, metavar="MIB")
        p.add_argument("-s", "--smp", type=int, default=None)
        p.add_argument("-C", "--cwd", default=None, help="guest working directory (default: repo)")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="kernel messages and the qemu command line")
        p.add_argument("--systemd", action="store_true",
                       help="the host's systemd as PID 1; the command runs as a service")
        add_kernel(p)

    def add_kernel(p):
        p.add_argument("-k", "--kernel", default=None, metavar="PKG",
                       help="kernel package to boot ('auth': the 6.12 one with NVMe in-band "
                            "authentication; default: the bed's usual kernel)")

    pr = sub.add_parser("run", help="run CMD (or -c SNIPPET) in a fresh VM")
    common(pr)
    pr.add_argument("-c", "--sh", default=None, metavar="SNIPPET", help="run bash -c SNIPPET")
    pr.add_argument("-l", "--log", default=None, metavar="FILE", help="copy of the console output")
    pr.add_argument("cmd", nargs=argparse.REMAINDER)
    ps = sub.add_parser("shell", help="interactive bash in a fresh VM (serial console)")
    common(ps)
    add_kernel(sub.add_parser("setup", help="fetch the kernel and build the initramfs, print paths"))
    a = ap.parse_args(argv)

    try:
        kernel_pkg = auth_kernel_pkg() if a.kernel == "auth" else a.kernel
        if a.sub == "setup":
            k, initrd = ensure_assets(kernel_pkg)
            print(f"kernel:    {k.pkg} ({k.version})\nvmlinuz:   {k.vmlinuz}\n"
                  f"modules:   {k.modules / k.version}\ninitramfs: {initrd}")
            return 0
        env = {}
        for e in a.env:
            if "=" not in e:
                ap.error("-e wants VAR=VALUE")
            k_, v = e.split("=", 1)
            env[k_] = v
        cwd = a.cwd or os.getcwd()
        if a.sub == "shell":
            if not sys.stdin.isatty():
                ap.error("shell needs a terminal")
            r = run("exec bash -l", rw=a.rw, env=env, timeout=a.timeout, cwd=cwd, mem=a.mem,
                    smp=a.smp, verbose=a.verbose, interactive=True, systemd=a.systemd,
                    kernel_pkg=kernel_pkg)
        else:
            cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
            if a.sh is not None:
                if cmd:
                    ap.error("give either -c SNIPPET or CMD, not both")
                cmd = a.sh
            elif not cmd:
                ap.error("nothing to run")
            r = run(cmd, rw=a.rw, env=env, timeout=a.timeout, log_path=a.log, echo=True,
                    cwd=cwd, mem=a.mem, smp=a.smp, verbose=a.verbose, systemd=a.systemd,
                    kernel_pkg=kernel_pkg)
    except VMError as e:
        log(f"error: {e}")
        return 125
    except KeyboardInterrupt:
        log("interrupted; VM killed")
        return 130
    log(r.summary())
    return r.rc


if __name__ == "__main__":
    sys.exit(main())
