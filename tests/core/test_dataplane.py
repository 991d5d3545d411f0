"""Which data plane runs, and that it is said: ``BLOCKD_PURE=1`` forces the Python twins,
``blockd --version`` and the daemons' start-up line name the one in use.

Each check runs in a subprocess: the choice is made once, at import.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BUILT = importlib.util.find_spec("blockd._pdu_reader") is not None
MAIN = "from blockd.cli.daemon import main; raise SystemExit(main())"


def run(code: str, *args: str, pure: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "BLOCKD_PURE"}
    if pure:
        env["BLOCKD_PURE"] = "1"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=60, check=True)


def test_ci_has_the_compiled_plane() -> None:
    if os.environ.get("CI") != "true":
        pytest.skip("only CI must have built it")
    assert BUILT


@pytest.mark.parametrize("pure", [False, True])
def test_version_names_the_data_plane(pure: bool) -> None:
    compiled = BUILT and not pure
    out = run(MAIN, "--version", pure=pure).stdout
    assert out.strip().endswith("data plane: compiled" if compiled else "data plane: pure Python"), out


@pytest.mark.parametrize("pure", [False, True])
def test_callers_get_the_chosen_reader(pure: bool) -> None:
    module = run("from blockd.tcp_pdu import PduReader; print(PduReader.__module__)", pure=pure).stdout.strip()
    assert module == ("blockd._pdu_reader" if BUILT and not pure else "blockd.pdu_reader")


@pytest.mark.parametrize("pure", [False, True])
def test_both_ends_get_the_chosen_batcher(pure: bool) -> None:
    module = run("from blockd.tcp_asyncio import OutputBatcher; print(OutputBatcher.__module__)", pure=pure).stdout.strip()
    assert module == ("blockd._output" if BUILT and not pure else "blockd.output")


@pytest.mark.parametrize("pure", [False, True])
def test_the_host_runs_the_chosen_fuse_loop_and_tcp_io(pure: bool) -> None:
    code = ("from initiator.tcp import TcpHostConnection, TcpHostIo\n"
            "from initiator.fuse.session import FuseSession\n"
            "s = FuseSession({}, 'c', '/nonexistent', 1.0)\n"
            "print(TcpHostIo.__module__, type(s.on_readable.__self__).__module__)")
    modules = run(code, pure=pure).stdout.split()
    compiled = BUILT and not pure
    assert modules == (["initiator._tcp_host_io", "initiator.fuse._loop"] if compiled
                       else ["initiator.tcp_host_io", "initiator.fuse.session"]), modules


@pytest.mark.parametrize("pure", [False, True])
def test_the_block_files_get_the_chosen_range_locks(pure: bool) -> None:
    module = run("from initiator.fuse.blockfile import RangeLocks; print(RangeLocks.__module__)", pure=pure).stdout.strip()
    assert module == ("initiator.fuse._rangelock" if BUILT and not pure else "initiator.fuse.rangelock")


def test_daemon_start_line_names_the_data_plane_and_why(tmp_path: Path) -> None:
    env = dict(os.environ, BLOCKD_PURE="1")
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "initiator", "--socket", str(tmp_path / "i.sock")],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "data plane: pure Python" in line and "BLOCKD_PURE is set" in line, line
