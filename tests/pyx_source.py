"""What the layer and contract tests read of the compiled sources (``*.pyx``, ``*.pxd``), without
compiling them: the attribute accesses of their code and the names their ``.pxd`` files declare.

Cython's syntax is Python's tokens plus a few (``<T>x`` casts, ``&x``, ``cdef``), so the
standard tokenizer reads it; comments and strings (docstrings) are dropped, so prose that names
``TcpTargetConnection._take`` is not code."""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPILED_DIRS = ("blockd", "target", "initiator")


def compiled_sources(suffix: str = ".pyx") -> list[Path]:
    """Every compiled module's source (``.pyx``) or declaration file (``.pxd``) in the packages."""
    return sorted(p for d in COMPILED_DIRS for p in (REPO / d).rglob(f"*{suffix}"))


def code_tokens(text: str) -> list[tokenize.TokenInfo]:
    """The tokens of ``text`` that are code: no comment, no string."""
    return [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.COMMENT, tokenize.STRING)]


@dataclass(frozen=True)
class Access:
    """``receiver.name`` in a compiled module's code (``a.b.c`` gives ``a.b`` and ``b.c``)."""
    receiver: str
    name: str
    line: int


_IMPORT_WORDS = frozenset({"from", "import", "cimport"})


def attribute_accesses(text: str) -> list[Access]:
    """Every ``a.b`` of the code but in import statements (``from blockd._le cimport``)."""
    toks = code_tokens(text)
    out: list[Access] = []
    importing = False
    first = True
    for a, dot, b in zip(toks, toks[1:], toks[2:]):
        if a.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            first = True
            continue
        if first and a.type != tokenize.NL:
            importing = a.string in _IMPORT_WORDS
            first = False
        if not importing and a.type == tokenize.NAME and dot.string == "." and b.type == tokenize.NAME:
            out.append(Access(a.string, b.string, a.start[0]))
    return out


_GETATTR = re.compile(r"""\bgetattr\(\s*(\w+)\s*,\s*["'](\w+)["']""")


def getattr_names(text: str) -> list[Access]:
    """``getattr(receiver, "name")`` with a literal name: an access too."""
    return [Access(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _GETATTR.finditer(text)]


_CDEF_LINE = re.compile(r"^\s*c(?:p)?def\s+(.*)$")
_DECLARED_NAME = re.compile(r"(\w+)\s*(?:\(|,|$|=)")


def cdef_names(text: str) -> set[str]:
    """Names a ``.pxd`` (or a ``.pyx``, for its own classes) declares at C level: cdef/cpdef functions and methods, cdef class fields,
    module-level cdef variables (the fields of a cdef class its cimporters may read)."""
    names: set[str] = set()
    for raw in text.splitlines():
        if raw.lstrip().startswith(("cdef extern", "cdef enum", "cdef struct", "ctypedef")):
            continue
        line = raw.split("#", 1)[0].rstrip().rstrip(":")
        m = _CDEF_LINE.match(line)
        if m is None:
            continue
        body = m.group(1)
        if body.startswith("class "):
            continue
        head = body.split("(", 1)
        if len(head) == 2:  # a function: the name before its parameters
            names.add(head[0].split()[-1].lstrip("*"))
            continue
        # fields: ``[public|readonly] type name[, name...]`` (the type's words come first)
        parts = [p.strip() for p in body.split(",")]
        names.update(p.split("=")[0].split()[-1].lstrip("*").split("[")[0] for p in parts if p.split("=")[0].split())
    return names


_FROM = re.compile(r"^from\s+([\w.]+)\s+c?import\s+(.+)$")
_PLAIN = re.compile(r"^c?import\s+(.+)$")


def compiled_imports(text: str) -> list[tuple[str, list[str], int]]:
    """Every ``import``/``cimport`` statement of a ``.pyx``/``.pxd``, wherever it sits (a lazy one
    in a function too): (the module after ``from``, or "" for a plain ``import``/``cimport``; the
    names imported, without their ``as`` aliases; the line)."""
    toks = code_tokens(text)
    found: list[tuple[str, list[str], int]] = []
    statement: list[str] = []
    line = 0
    for t in toks:
        if t.type in (tokenize.NEWLINE, tokenize.ENDMARKER) or (t.type == tokenize.NL and not statement):
            if statement and statement[0] in _IMPORT_WORDS:
                code = " ".join(statement).replace(" . ", ".").replace("( ", "").replace(" )", "")
                code = code.replace("(", "").replace(")", "")
                m = _FROM.match(code)
                plain = _PLAIN.match(code) if m is None else None
                names = (m.group(2) if m else plain.group(1) if plain else "").split(",")
                found.append((m.group(1) if m else "", [n.split(" as ")[0].strip().replace(" ", "")
                                                        for n in names if n.strip()], line))
            statement = []
            continue
        if t.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            continue
        if not statement:
            line = t.start[0]
        statement.append(t.string)
    return found
