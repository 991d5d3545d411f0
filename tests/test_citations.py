"""Citations point at documents in the repository: every ``docs/*.md`` a file mentions exists,
and every section of ``docs/wire-facts.md`` cited by name is a heading there. Documents kept
outside the repository (a machine's shared notes, an issue tracker) are invisible to a reader of
the code, so the code does not cite them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WIRE_FACTS = REPO / "docs" / "wire-facts.md"
_DOC_PATH = re.compile(r"\bdocs/[\w.-]+\.md\b")
_SECTION = re.compile(r'docs/wire-facts\.md,\s+(?:#\s*)?"([^"]+)"')


def _tracked_text_files() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    texts = {}
    for name in names:
        path = REPO / name
        if path.suffix in {".py", ".md", ".sh", ".service", ".toml", ""} and path.is_file():
            try:
                texts[name] = path.read_text()
            except UnicodeDecodeError:
                continue
    return texts


def _headings(markdown: str) -> set[str]:
    return {line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")}


def _missing_sections(texts: dict[str, str], headings: set[str]) -> list[str]:
    missing = []
    for name, text in texts.items():
        for match in _SECTION.finditer(text):
            title = " ".join(match.group(1).split())
            if title not in headings:
                missing.append(f"{name}: {title!r}")
    return missing


def test_cited_documents_exist() -> None:
    missing = sorted({f"{name}: {ref}" for name, text in _tracked_text_files().items()
                      for ref in _DOC_PATH.findall(text) if not (REPO / ref).is_file()})
    assert missing == []


def test_cited_wire_fact_sections_exist() -> None:
    texts = _tracked_text_files()
    assert any(_SECTION.search(text) for text in texts.values())  # the check has work to do
    assert _missing_sections(texts, _headings(WIRE_FACTS.read_text())) == []


def test_a_missing_section_is_reported() -> None:
    texts = {"a.py": '# docs/wire-facts.md, "Status word"\n(docs/wire-facts.md,\n "No such\n  section")'}
    assert _missing_sections(texts, {"Status word"}) == ["a.py: 'No such section'"]
