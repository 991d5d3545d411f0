"""``blockctl install-units``: write blockd's systemd units with this installation's paths.

The units in the repository's ``systemd/`` name ``/usr/local/bin/blockd`` and
``/usr/local/bin/blockctl`` (where ``pip install`` puts them system-wide).  ``install-units``
rewrites those to the executables next to the running interpreter (a venv works), writes the
units to ``/etc/systemd/system`` and runs ``systemctl daemon-reload`` when systemd is PID 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

UNITS = ("blockd-target.service", "blockd-initiator.service", "blockd-rxe@.service")
PLACEHOLDERS = {"blockd": "/usr/local/bin/blockd", "blockctl": "/usr/local/bin/blockctl"}
DEFAULT_DEST = "/etc/systemd/system"


def source_dir() -> Path:
    """The ``systemd/`` folder of the source tree this package runs from."""
    here = Path(__file__).resolve().parent.parent / "systemd"
    if not (here / UNITS[0]).is_file():
        raise FileNotFoundError(f"no unit files at {here} (install-units needs the source tree's "
                                "systemd/ folder: run it from a checkout or an editable install)")
    return here


def default_bin_dir() -> Path:
    """The folder holding this installation's ``blockd``/``blockctl`` scripts."""
    cand = [Path(sys.executable).parent, Path(sys.argv[0]).resolve().parent]
    for d in cand:
        if (d / "blockd").exists() and (d / "blockctl").exists():
            return d
    found = shutil.which("blockd")
    if found:
        return Path(found).resolve().parent
    return cand[0]


def render(text: str, bin_dir: Path) -> str:
    """Unit text with this installation's executable paths (ProtectHome/PrivateTmp relaxed
    when the executables live where they would hide them)."""
    for name, placeholder in PLACEHOLDERS.items():
        text = text.replace(placeholder, str(bin_dir / name))
    resolved = str(bin_dir.resolve())

    def under(*roots: str) -> bool:
        return any(resolved == r or resolved.startswith(r + "/") for r in roots)

    if under("/home", "/root", "/run/user"):
        text = text.replace("ProtectHome=yes", "ProtectHome=read-only")
    if under("/tmp", "/var/tmp"):  # e.g. a CI checkout: a private /tmp would not contain it
        text = text.replace("PrivateTmp=yes", "PrivateTmp=no")
    return text


def systemd_booted() -> bool:
    """sd_booted(3): systemd is PID 1."""
    return os.path.isdir("/run/systemd/system")


def install(dest: Path, bin_dir: Path, reload: bool = True, out=sys.stdout) -> list[Path]:
    src = source_dir()
    for name in PLACEHOLDERS:
        exe = bin_dir / name
        if not os.access(exe, os.X_OK):
            raise FileNotFoundError(f"{exe} is not an executable: give --bin-dir")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for unit in UNITS:
        target = dest / unit
        tmp = target.with_name(f".{unit}.tmp")
        tmp.write_text(render((src / unit).read_text(), bin_dir))
        tmp.chmod(0o644)
        tmp.replace(target)
        written.append(target)
        print(f"wrote {target}", file=out)
    if reload:
        if systemd_booted() and shutil.which("systemctl"):
            subprocess.run(["systemctl", "daemon-reload"], check=True)
            print("systemctl daemon-reload: done", file=out)
        else:
            print("systemd is not PID 1 here: skipped systemctl daemon-reload", file=out)
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dest", default=DEFAULT_DEST, help=f"unit directory (default {DEFAULT_DEST})")
    p.add_argument("--bin-dir", type=Path, default=None,
                   help="folder with the blockd and blockctl executables (default: this installation's)")
    p.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")


def run(args: argparse.Namespace, prog: str = "blockctl install-units") -> int:
    try:
        install(Path(args.dest), args.bin_dir or default_bin_dir(), reload=not args.no_reload)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None, prog: str = "blockctl install-units") -> int:
    p = argparse.ArgumentParser(prog=prog, description="install blockd's systemd units")
    add_arguments(p)
    return run(p.parse_args(argv), prog)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m blockd.units"))
