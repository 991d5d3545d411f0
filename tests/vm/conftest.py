"""pytest integration of the VM test bed (tests/vm/harness.py).

A *group* is one host test module (tests/vm/test_*.py) paired with the guest test file(s)
(tests/vm/guest_tests/test_*.py) named by the module's ``GUEST_TESTS`` (a path or a tuple).  The first test of
the module that uses the ``guest_case`` fixture boots the VM ONCE for the whole module
(module-scoped ``vm_group``) and runs, inside it, pytest on the guest file -- only the guest
tests whose host twins are selected (``-k`` works) -- writing a JUnit XML report into a
read-write share.  Every host test then looks up the guest test of the same name and
passes, fails or skips on its own.

Results of a group stay in ``results/vm/<group>/`` (``$BLOCKD_VM_RESULTS_ROOT`` overrides
``results/vm``): ``console.log`` (the VM console), ``junit.xml``, daemon logs.
``timings.json``.  A module with ``VM_AUTH_KERNEL = True`` boots the 6.12 kernel package that
has NVMe in-band authentication (``harness.auth_kernel_pkg``) instead of the default one.
``BLOCKD_VM_ECHO=1`` streams the VM console to the terminal (use -s).
Tests marked ``vm`` are skipped, with the reason, where qemu and friends are missing
(``$BLOCKD_VM_QEMU`` names the qemu binary); under ``CI=true`` that skip is a failure
(``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import harness

IN_VM = os.environ.get("BLOCKD_VM") == "1"
# The guest files are collected only inside the VM (tests/conftest.py keeps them out on the host).

_TIMINGS: list[str] = []


def pytest_collection_modifyitems(config, items):
    if IN_VM:
        return
    reason = None
    has_timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        if item.get_closest_marker("vm") is None:
            continue
        # the first test of a group boots the VM in its setup: give pytest-timeout room
        vm_timeout = getattr(getattr(item, "module", None), "VM_TIMEOUT", None)
        if has_timeout and vm_timeout and "guest_case" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(int(vm_timeout) + 120))
        if reason is None:
            reason = harness.skip_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    if _TIMINGS:
        terminalreporter.section("VM test bed timings")
        for line in _TIMINGS:
            terminalreporter.write_line(line)


@dataclass
class GuestCase:
    name: str
    outcome: str            # passed | failed | error | skipped
    message: str = ""
    text: str = ""
    time: float = 0.0
    properties: dict[str, str] = field(default_factory=dict)
    output: str = ""        # captured stdout/stderr of the guest test
    results: Path | None = None


@dataclass
class GroupRun:
    name: str
    results: Path
    vm: harness.VMResult | None
    cases: dict[str, GuestCase]
    error: str = ""

    def describe_failure(self) -> str:
        parts = [f"VM group {self.name!r}: {self.error or (self.vm.summary() if self.vm else '')}",
                 f"results: {self.results}"]
        if self.vm is not None:
            parts.append("--- last console lines\n" + self.vm.tail(60))
        return "\n".join(parts)


def _parse_junit(path: Path) -> dict[str, GuestCase]:
    cases: dict[str, GuestCase] = {}
    root = ET.parse(path).getroot()
    for tc in root.iter("testcase"):
        name = tc.get("name", "")
        outcome, message, text = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message, text = el.get("message", ""), (el.text or "")
                break
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        out = "\n".join((el.text or "") for el in tc if el.tag in ("system-out", "system-err"))
        prev = cases.get(name)
        # a test that passed its call but errored in teardown appears twice: keep the worst
        if prev is not None and prev.outcome in ("failed", "error"):
            continue
        cases[name] = GuestCase(name, outcome, message, text, float(tc.get("time", 0) or 0),
                                props, out)
    return cases


def _guest_file_of(test: str, files: list[str]) -> str:
    """The guest file (of a group's ``GUEST_TESTS``, a path or a list of paths) defining ``test``."""
    for f in files:
        path = harness.REPO / f
        if f"def {test}(" in path.read_text():
            return str(path)
    raise pytest.UsageError(f"no guest test {test} in {', '.join(files)}")


def _guest_python() -> str:
    venv = harness.REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _results_root() -> Path:
    env = os.environ.get("BLOCKD_VM_RESULTS_ROOT")
    return Path(env) if env else harness.REPO / "results" / "vm"


@pytest.fixture(scope="module")
def vm_group(request) -> GroupRun:
    """Boot the VM once for this module and run its guest tests; see the module docstring."""
    mod = request.module
    guest_file = getattr(mod, "GUEST_TESTS")
    timeout = float(getattr(mod, "VM_TIMEOUT", 480))
    group = Path(mod.__file__).stem.removeprefix("test_")
    selected = [it.name for it in request.session.items
                if getattr(it, "module", None) is mod and "guest_case" in getattr(it, "fixturenames", ())
                and it.get_closest_marker("skip") is None]
    res = _results_root() / group
    shutil.rmtree(res, ignore_errors=True)
    res.mkdir(parents=True)
    junit = res / "junit.xml"
    guest_files = [guest_file] if isinstance(guest_file, str) else list(guest_file)
    cmd = [_guest_python(), "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
           "-o", "junit_logging=all", "-o", "junit_family=xunit1", f"--junitxml={junit}",
           "-q", "-rA",
           *[f"{_guest_file_of(n, guest_files)}::{n}" for n in selected]]
    t0 = time.monotonic()
    try:
        vm = harness.run(cmd, rw=[res], env={"BLOCKD_VM_RESULTS": str(res)}, timeout=timeout,
                         log_path=res / "console.log", cwd=harness.REPO,
                         echo=os.environ.get("BLOCKD_VM_ECHO") == "1",
                         kernel_pkg=harness.auth_kernel_pkg() if getattr(mod, "VM_AUTH_KERNEL", False) else None,
                         **({"systemd": True} if getattr(mod, "VM_SYSTEMD", False) else {}))
    except harness.VMError as e:
        pytest.fail(f"VM test bed could not start: {e}", pytrace=False)
    cases: dict[str, GuestCase] = {}
    error = ""
    if junit.exists():
        try:
            cases = _parse_junit(junit)
        except ET.ParseError as e:
            error = f"unreadable {junit}: {e}"
    else:
        error = f"the guest wrote no JUnit report ({vm.summary()})"
    boot = f"{vm.t_start:.1f}s" if vm.t_start is not None else "?"
    per_case = ", ".join(f"{c.name} {c.outcome} {c.time:.1f}s" for c in cases.values())
    _TIMINGS.append(f"{group}: boot {boot}, {vm.summary()}, host wall "
                    f"{time.monotonic() - t0:.1f}s; {per_case}")
    (res / "timings.json").write_text(json.dumps({
        "group": group, "rc": vm.rc, "timed_out": vm.timed_out, "wall_s": round(vm.wall, 1),
        "guest_uptime_at_start_s": vm.t_start, "guest_uptime_at_end_s": vm.t_end,
        "cases": {c.name: {"outcome": c.outcome, "time_s": c.time} for c in cases.values()},
    }, indent=1) + "\n")
    return GroupRun(group, res, vm, cases, error)


@pytest.fixture
def guest_case(request, vm_group: GroupRun) -> GuestCase:
    """The in-VM result of the guest test named like this host test.

    The verdict is applied when the test is *called* (pytest_runtest_call below), so a
    guest failure shows as a FAILED host test, a guest skip as SKIPPED; the test body runs
    only when the guest test passed and may check ``properties`` further.
    """
    name = request.node.name
    case = vm_group.cases.get(name)
    if case is None:
        case = GuestCase(name, "missing",
                         f"the guest reported nothing for {name}\n{vm_group.describe_failure()}")
    case.results = vm_group.results
    return case


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    case = getattr(item, "funcargs", {}).get("guest_case")
    if not isinstance(case, GuestCase):
        return
    if case.outcome == "missing":
        pytest.fail(case.message, pytrace=False)
    if case.outcome == "skipped":
        pytest.skip(f"skipped in the VM: {case.message}")
    if case.outcome != "passed":
        pytest.fail(f"{case.name} {case.outcome} in the VM: {case.message}\n{case.text}\n"
                    f"--- guest output\n{case.output[-6000:]}\n"
                    f"(results: {case.results})", pytrace=False)
