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


# ``from tests.x import``/``import tests.x`` (conftest or another test module as a package)
# and a path walk out of the repository.
OTHER_WAYS = re.compile(r"^\s*(?:from|import)\s+tests\b|parents\[[3-9]\]", re.M)


def test_tests_import_their_helpers_one_way() -> None:
    """Helpers come by name from ``conftest`` or a helper module beside it (tests/*.py);
    never through the ``tests`` package, never from another test module, and no walk out
    of the repo."""
    offenders = []
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    for path in TESTS.rglob("*.py"):
        if path == Path(__file__):
            continue
        text = path.read_text()
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, re.M))
        if OTHER_WAYS.search(text) or imported & test_modules:
            offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_the_guard_sees_each_other_way() -> None:
    """The patterns above catch the ways that were in use before."""
    for line in ("from tests.conftest import REPO", "import tests.conftest",
                 "from tests.unit.test_stragglers import slot, view",
                 "    from tests.integration.test_hang import _acting",
                 'REPO = Path(__file__).resolve().parents[3]'):
        assert OTHER_WAYS.search(line), line
    assert not OTHER_WAYS.search("from conftest import REAL_FIXTURES\nimport testsuite\n")


# A duration measured by the test and compared with a limit: timing belongs in benchmarks/.
# (A wait loop's ``assert time.monotonic() < deadline`` bounds the test, not the code.)
WALL_CLOCK_BOUND = re.compile(
    r"^\s*assert\b[^\n#]*(?:\b(?:elapsed|duration|wall_s)\b[^\n#]*<"
    r"|time\.(?:monotonic|perf_counter|time)\(\)\s*-\s*\w+[^\n#]*<)", re.M)


def test_no_test_asserts_a_wall_clock_bound() -> None:
    """Performance is measured in benchmarks against a same-run reference, never asserted
    by a test (a loaded CI machine would make it flaky)."""
    offenders = [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
                 for path in TESTS.rglob("*.py") if path != Path(__file__)
                 for text in [path.read_text()] for m in WALL_CLOCK_BOUND.finditer(text)]
    assert offenders == []
    for line in ("    assert elapsed < 0.5", "assert time.monotonic() - start < 2.0",
                 "    assert report.duration <= 1.0"):
        assert WALL_CLOCK_BOUND.search(line), line
    assert not WALL_CLOCK_BOUND.search("        assert time.monotonic() < deadline, 'x'")
