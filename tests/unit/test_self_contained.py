"""The test suite stands on its own: its real captures live in the repo, described in SOURCES.md."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REAL_FIXTURES, REPO

TESTS = REPO / "tests"


def _captures() -> set[str]:
    return {p.name for p in REAL_FIXTURES.iterdir() if p.is_dir()}


def test_real_captures_are_read_from_inside_the_repository() -> None:
    """REAL_FIXTURES is tests/fixtures in this checkout, not a directory beside it."""
    assert REAL_FIXTURES == TESTS / "fixtures"
    assert REAL_FIXTURES.is_dir() and _captures()


def test_every_capture_has_a_source_row_and_every_row_a_capture() -> None:
    """tests/fixtures/SOURCES.md names where each copied capture came from, and nothing more."""
    text = (REAL_FIXTURES / "SOURCES.md").read_text()
    first_cells = re.findall(r"^\| (`.*?) \|", text, re.M)
    rows = {name.rstrip("/").rsplit("/", 1)[-1]
            for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}
    top = {p.name for d in REAL_FIXTURES.iterdir() if d.is_dir() for p in d.iterdir()}
    assert rows == top


def test_tests_import_their_helpers_one_way() -> None:
    """Helpers come from ``conftest`` by name; no ``tests.conftest``, no walk out of the repo."""
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path == Path(__file__):
            continue
        text = path.read_text()
        if "from tests.conftest" in text or "import tests.conftest" in text \
                or re.search(r"parents\[[3-9]\]", text):
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
