"""The package layers, read from the source with ``ast`` (nothing is imported, so a module that
needs pyverbs or root is checked like any other).

From the bottom up:

* ``protocol/``: the wire layouts; imports nothing of blockd's other packages.
* ``blockd/`` (but ``blockd/cli/``): what the target and the host share (framing, the RDMA
  layer, config, logging); imports neither ``target/`` nor ``initiator/``.
* ``target/`` and ``initiator/``: the two ends; neither imports the other.
* ``blockd/cli/``: the command-line entry points, on top of everything; nothing imports them.

No module takes part in an import cycle, and the sans-I/O modules import no event loop and no
socket, directly or through the project modules they import.

The compiled modules count too: a ``.pyx``'s ``import`` and ``cimport`` statements, and its
``.pxd``'s, are the module's imports (read by ``tests/pyx_source.py``), so a compiled module is
held to the layers it sits in, and the compiled transports to theirs: the NVMe/RDMA path cimports
the core and file modules, never a TCP one.

Every import counts, at module level or inside a function (a lazy import is still a dependency,
it only fails later). Imports under ``if TYPE_CHECKING:`` count for the package layers but not
for cycles: they never run, and two classes that name each other in annotations (a controller
and its queues) do not make a load order.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pyx_source import compiled_imports

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "blockd", "target", "initiator")
CLI = "blockd.cli"

SANS_IO = ("protocol", "blockd.tcp_pdu", "initiator.queue")
"""Modules (or packages) driven by bytes in, bytes out: no event loop, no socket."""
IO_MODULES = frozenset({"asyncio", "socket", "selectors", "ssl", "uvloop"})


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    """The imported module: a project module's dotted name, or the top-level name of another."""
    line: int
    typing_only: bool

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target} ({_path_of(self.importer)}:{self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _path_of(module: str) -> str:
    base = REPO.joinpath(*module.split("."))
    return str((base / "__init__.py" if base.is_dir() else base.with_suffix(".py")).relative_to(REPO))


def _project_modules() -> dict[str, Path]:
    """Every module of the packages by name: its ``.py``, or a compiled one's ``.pyx``."""
    return {_module_name(p): p for pkg in PACKAGES for ext in ("*.py", "*.pyx") for p in sorted((REPO / pkg).rglob(ext))}


def _compiled_module_imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports and cimports of a compiled module, from its ``.pyx`` and its ``.pxd``."""
    found = []
    for source in (path, path.with_suffix(".pxd")):
        if not source.exists():
            continue
        for origin, names, line in compiled_imports(source.read_text()):
            for name in names if not origin else [f"{origin}.{n}" for n in names]:
                target = name if name in modules else (origin or name)
                found.append(Import(module, target if target.split(".")[0] in PACKAGES else target.split(".")[0],
                                    line, False))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import statement of ``module``, wherever it sits, resolved to the module it loads."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(name: str) -> str:
        return name if name.split(".")[0] in PACKAGES else name.split(".")[0]

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, resolve(alias.name), node.lineno, typing_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from pkg import mod`` loads the submodule; ``from mod import name`` the module.
                sub = f"{source}.{alias.name}"
                found.append(Import(module, sub if sub in modules else resolve(source), node.lineno,
                                    typing_only))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _all_imports() -> list[Import]:
    modules = _project_modules()
    return [imp for name, path in modules.items()
            for imp in (_compiled_module_imports if path.suffix == ".pyx" else _imports)(name, path, modules)]


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = imp.importer, imp.target
        if _in(src, "protocol") and any(_in(dst, p) for p in ("blockd", "target", "initiator")):
            bad.append(f"protocol/ imports an upper layer: {imp}")
        if _in(src, "blockd") and not _in(src, CLI) and (_in(dst, "target") or _in(dst, "initiator")):
            bad.append(f"blockd/ (shared, below both ends) imports an end: {imp}")
        if (_in(src, "target") and _in(dst, "initiator")) or (_in(src, "initiator") and _in(dst, "target")):
            bad.append(f"the two ends import each other: {imp}")
        if _in(dst, CLI) and not _in(src, CLI):
            bad.append(f"an entry point is imported from below: {imp}")
    return bad


def _cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over runtime imports."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.typing_only and imp.target != imp.importer and imp.target.split(".")[0] in PACKAGES:
            graph.setdefault(imp.importer, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _io_violations(imports: list[Import]) -> list[str]:
    """Sans-I/O modules that reach an I/O module, directly or through project modules."""
    by_importer: dict[str, list[Import]] = {}
    for imp in imports:
        if not imp.typing_only:
            by_importer.setdefault(imp.importer, []).append(imp)
    bad = []
    for root in sorted(by_importer):
        if not any(_in(root, s) for s in SANS_IO):
            continue
        seen, todo, via = {root}, [root], {root: [root]}
        while todo:
            module = todo.pop()
            for imp in by_importer.get(module, ()):
                if imp.target in IO_MODULES:
                    bad.append(f"{' -> '.join(via[module])} imports {imp.target} "
                               f"({_path_of(module)}:{imp.line})")
                elif imp.target.split(".")[0] in PACKAGES and imp.target not in seen:
                    seen.add(imp.target)
                    via[imp.target] = via[module] + [imp.target]
                    todo.append(imp.target)
    return bad


def test_packages_import_only_downwards() -> None:
    assert _layer_violations(_all_imports()) == []


def test_no_import_cycles() -> None:
    imports = _all_imports()
    edges = [str(imp) for component in _cycles(imports) for imp in imports
             if not imp.typing_only and imp.importer in component and imp.target in component]
    assert edges == []


def test_sans_io_modules_import_no_event_loop_or_socket() -> None:
    assert _io_violations(_all_imports()) == []


def test_every_import_kind_is_seen() -> None:
    """The checks above are only as good as the parser: module-level, lazy (in a function),
    relative and TYPE_CHECKING imports are all found where the source has them today."""
    imports = _all_imports()

    def has(importer: str, target: str, typing_only: bool = False) -> bool:
        return any(i.importer == importer and i.target == target and i.typing_only == typing_only
                   for i in imports)

    assert has("blockd.tcp_asyncio", "asyncio")                      # module level
    assert has("blockd.cli.daemon", "target.service")                 # inside a function
    assert has("blockd.rdma.slots", "blockd.rdma.verbs")              # from .verbs import
    assert has("target.controller", "target.queue", typing_only=True)  # if TYPE_CHECKING:
    assert has("target._rdma_fast", "target._io_core")                # a .pyx's cimport
    assert has("target._rdma_fast", "target.rdma")                    # a .pyx's lazy import
    assert has("target._tcp_io", "blockd._pdu_reader")                # cimport of a .pxd's class
    assert has("target._io_core", "target._file_io")                  # a .pxd's cimport


TRANSPORT_MODULES = {"tcp": ("target.tcp", "target._tcp_io", "target._tcp_thread"),
                     "rdma": ("target.rdma", "target._rdma_fast")}
"""The target's transport modules, Python and compiled, by transport."""


def _cross_transport(imports: list[Import]) -> list[str]:
    """A compiled transport module that imports another transport's module."""
    return [str(imp) for imp in imports for name, own in TRANSPORT_MODULES.items()
            if imp.importer in own[1:]
            for other, theirs in TRANSPORT_MODULES.items() if other != name and imp.target in theirs]


def test_a_compiled_transport_imports_no_other_transport() -> None:
    """The RDMA path takes the core and the file I/O from their own modules, not from the TCP
    one (as the kernel's ``rdma.c`` calls ``core.c`` and ``io-cmd-file.c``, not ``tcp.c``)."""
    assert _cross_transport(_all_imports()) == []


def test_a_cross_transport_cimport_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "_rdma_fast.pyx"
    path.write_text("from target._tcp_io cimport TcpFastPath\nfrom target._io_core cimport eligible\n")
    found = _cross_transport(_compiled_module_imports("target._rdma_fast", path, _project_modules()))
    assert len(found) == 1 and "target._tcp_io" in found[0]


@pytest.mark.parametrize("source, rule", [
    ("from target.queue import TargetQueue\n", "blockd/ (shared"),
    ("def lazy() -> None:\n    import initiator.controller\n", "blockd/ (shared"),
    ("from blockd.cli import daemon\n", "an entry point"),
])
def test_a_forbidden_import_is_reported(tmp_path: Path, source: str, rule: str) -> None:
    """The layer check reports what it should, for an import placed in a shared module."""
    modules = _project_modules()
    path = tmp_path / "shared.py"
    path.write_text(source)
    found = _layer_violations(_imports("blockd.shared", path, modules))
    assert len(found) == 1 and rule in found[0]


def test_a_cycle_is_reported() -> None:
    imports = [Import("blockd.a", "blockd.b", 1, False), Import("blockd.b", "blockd.a", 1, False),
               Import("blockd.c", "blockd.a", 1, True), Import("blockd.a", "blockd.c", 1, False)]
    assert _cycles(imports) == [["blockd.a", "blockd.b"]]


def test_io_reached_through_a_project_module_is_reported() -> None:
    imports = [Import("blockd.tcp_pdu", "protocol.tcp", 1, False),
               Import("protocol.tcp", "socket", 3, False)]
    assert any(v.startswith("blockd.tcp_pdu -> protocol.tcp imports socket") for v in _io_violations(imports))


def _module_assignments(name: str) -> list[str]:
    """The project modules that assign ``name`` at module level."""
    found = []
    for module, path in _project_modules().items():
        if path.suffix == ".pyx":  # Cython, not Python: a module-level assignment is a line of its own
            if re.search(rf"^{name}\s*=", path.read_text(), re.M):
                found.append(module)
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(module)
    return found


def _transport_name_lists() -> list[str]:
    """Tuples, lists and sets written out of exactly the transport names (issue 36: the names
    come from the registries, ``target/transport.py`` and ``initiator/transport.py``)."""
    found = []
    for module, path in _project_modules().items():
        if path.suffix == ".pyx":
            found += [f"{path.relative_to(REPO)}:{m.group(0)}" for m in re.finditer(
                r"[(\[{]\s*(['\"])(tcp|rdma)\1\s*,\s*(['\"])(?!\2)(tcp|rdma)\3\s*,?\s*[)\]}]", path.read_text())]
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) for e in node.elts) and {
                    e.value for e in node.elts} == {"tcp", "rdma"}:
                found.append(f"{_path_of(module)}:{node.lineno}")
    return found


def test_each_thing_is_defined_in_its_one_place() -> None:
    """The RDMA transport drives queues: the raw cm_id read (ctypes) and the netdev discovery
    (pyroute2) are ``blockd/rdma``'s; the SQE and CQE sizes are ``protocol/nvme.py``'s; no list
    of transport names is written out beside the registries."""
    rdma = {i.target for i in _all_imports() if i.importer == "target.rdma"}
    assert rdma & {"ctypes", "pyroute2"} == set()
    assert (_module_assignments("SQE_SIZE"), _module_assignments("CQE_SIZE")) == (["protocol.nvme"], ["protocol.nvme"])
    assert _transport_name_lists() == []
