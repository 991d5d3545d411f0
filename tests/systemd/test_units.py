"""The systemd units: `systemd-analyze verify` on each (as installed by `blockctl install-units`).

Without systemd-analyze they skip; under ``CI=true`` that skip is a failure (``tests/conftest.py``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from blockd import units

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("units")
    bin_dir = VENV_BIN if (VENV_BIN / "blockd").exists() else units.default_bin_dir()
    units.install(dest, bin_dir, reload=False)
    return dest


@needs_analyze
@pytest.mark.parametrize("unit", ["blockd-target.service", "blockd-initiator.service",
                                  "blockd-rxe@lo.service", "blockd-rxe@.service"])
def test_systemd_analyze_verify(installed, unit):
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(installed / unit)],
                       capture_output=True, text=True, cwd=installed, timeout=60)
    # verify exits 0 even for unknown keys / bad values: any line about our units is a failure
    ours = [ln for ln in (r.stdout + r.stderr).splitlines()
            if str(installed) in ln or "blockd" in ln]
    assert r.returncode == 0 and not ours, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_install_rewrites_exec_paths(installed):
    bin_dir = VENV_BIN if (VENV_BIN / "blockd").exists() else units.default_bin_dir()
    for unit in units.UNITS:
        text = (installed / unit).read_text()
        assert "/usr/local/bin/" not in text
        for line in text.splitlines():
            if line.startswith(("ExecStart=", "ExecStop=")):
                exe = line.split("=", 1)[1].split()[0]
                assert exe.startswith(str(bin_dir)), line
                assert Path(exe).exists(), line


def test_render_relaxes_protecthome_for_home_installs():
    text = units.render("ExecStart=/usr/local/bin/blockd target\nProtectHome=yes\n",
                        Path("/home/u/venv/bin"))
    assert "ExecStart=/home/u/venv/bin/blockd target" in text
    assert "ProtectHome=read-only" in text


def _directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_target_unit_contract():
    d = _directives("blockd-target.service")
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert "WatchdogSec" in d and d["Restart"] == ["on-failure"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["LimitMEMLOCK"] == ["infinity"]
    assert d["ProtectSystem"] == ["strict"] and d["ReadWritePaths"] == ["/var/lib/blockd"]
    assert d["NoNewPrivileges"] == ["yes"] and d["ProtectHome"] == ["yes"] and d["PrivateTmp"] == ["yes"]
    assert d["CapabilityBoundingSet"] == ["CAP_IPC_LOCK"]
    assert "--config /etc/blockd/target.toml" in d["ExecStart"][0]
    assert "--log-format json" in d["ExecStart"][0]


def test_rxe_unit_contract():
    d = _directives("blockd-rxe@.service")
    assert d["Type"] == ["oneshot"] and d["RemainAfterExit"] == ["yes"]
    assert d["ExecStart"][0].endswith("blockctl rxe add %i --name rxe_%i")
    assert d["ExecStop"][0].endswith("blockctl rxe del rxe_%i")
    assert "blockd-target.service" in d["Before"][0]


def test_initiator_unit_has_no_mount_namespace():
    # FUSE mounts made by the daemon must be visible outside the service
    d = _directives("blockd-initiator.service")
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectControlGroups", "ReadWritePaths"):
        assert key not in d, key
    assert "/dev/fuse rw" in d["DeviceAllow"]
    assert "--config /etc/blockd/initiator.toml" in d["ExecStart"][0]
