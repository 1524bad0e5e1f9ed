"""Every test, bench script and example that README.md and the guides name as the proof of a claim exists,
and so does every test function they name: a renamed or merged test cannot leave a claim without its proof."""

from __future__ import annotations

import re
from pathlib import Path

from _mm import REPO

DOCS = [
    REPO / "README.md",
    *sorted(REPO.glob("docs/*.md")),
    *sorted(REPO.glob("docs/zh/*.md")),
    *sorted(REPO.glob("packages/*/README.md")),
    *sorted(REPO.glob("examples/*/README.md")),
]
#: a path under tests/, tools/ or examples/ (of the repository or of the document's own package or example)
PATH = re.compile(r"((?:packages/[\w.-]+/)?(?:tests|tools|examples)/[\w./*-]+\.(?:py|sh))(::\w+)?")
#: a test file named alone, with an optional ::function
TEST_FILE = re.compile(r"(test_\w+\.py)(::\w+)?")
#: a test function named alone: `::test_name`
TEST_FUNCTION = re.compile(r"`::(test_\w+)`")


def _test_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for root in (REPO / "tests", *REPO.glob("packages/*/tests"), *REPO.glob("examples/*")):
        for path in root.rglob("test_*.py"):
            found.setdefault(path.name, []).append(path)
    return found


def _defines(paths: list[Path], function: str) -> bool:
    return any(re.search(rf"def {function}\b", p.read_text(encoding="utf-8")) for p in paths)


def _unresolved(doc: Path, text: str, tests: dict[str, list[Path]]) -> set[str]:
    bad = set()
    home = doc.parent if doc.parent.parent.name in ("packages", "examples") else REPO
    for m in PATH.finditer(text):
        hits = [p for base in {REPO, home} for p in base.glob(m.group(1))]
        if not hits or (m.group(2) and not _defines(hits, m.group(2)[2:])):
            bad.add(m.group(0))
    for m in TEST_FILE.finditer(text):
        if m.group(1) not in tests or (m.group(2) and not _defines(tests[m.group(1)], m.group(2)[2:])):
            bad.add(m.group(0))
    every = [p for paths in tests.values() for p in paths]
    bad |= {m.group(1) for m in TEST_FUNCTION.finditer(text) if not _defines(every, m.group(1))}
    return bad


def test_every_named_proof_exists() -> None:
    tests = _test_files()
    missing = {
        str(doc.relative_to(REPO)): sorted(bad)
        for doc in DOCS
        if (bad := _unresolved(doc, doc.read_text(encoding="utf-8"), tests))
    }
    assert not missing, f"documents name tests or scripts that do not exist: {missing}"
