"""The test suite stands on its own: its real captures live in the repo, described in SOURCES.md."""

from __future__ import annotations

import ast
import os
import pwd
import re
import subprocess
import tempfile
from pathlib import Path

from conftest import PYTHON_SYS, REAL_FIXTURES, REPO, as_user, make_traversable

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


# What starts a child process directly; ``sandbox.run(..., user=)`` goes through runuser,
# which sets the groups itself.
_SPAWNERS = {"run", "Popen", "check_output", "check_call", "call"}
_IDENTITY = {"user", "group", "extra_groups"}


def _spawns_as_user_by_hand(node: ast.Call) -> bool:
    func = node.func
    direct = (isinstance(func, ast.Attribute) and func.attr in _SPAWNERS
              and isinstance(func.value, ast.Name) and func.value.id == "subprocess")
    direct = direct or (isinstance(func, ast.Name) and func.id == "start_sleeper")
    return direct and any(k.arg in _IDENTITY for k in node.keywords)


def test_every_process_started_as_a_user_goes_through_as_user() -> None:
    """No test passes ``user=``/``group=`` to subprocess by hand: ``user=`` alone keeps
    root's gid and groups, so the child is not the unprivileged user it claims to be."""
    offenders = [f"{path.relative_to(REPO)}:{node.lineno}"
                 for path in TESTS.rglob("*.py") if path != Path(__file__)
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and _spawns_as_user_by_hand(node)]
    assert offenders == []
    for line in ("subprocess.run(['id'], user=1000)", "start_sleeper({}, group=5)",
                 "subprocess.Popen(['id'], user='u', extra_groups=[])"):
        call = ast.parse(line).body[0].value  # type: ignore[attr-defined]
        assert _spawns_as_user_by_hand(call), line
    assert not _spawns_as_user_by_hand(
        ast.parse("sandbox.run(['id'], user='u')").body[0].value)  # type: ignore[attr-defined]


_IDENTITY_PROBE = """
import os, sys
print(os.getuid(), os.getgid(), sorted(set(os.getgroups())))
print(open(sys.argv[1]).read())
"""


def test_as_user_gives_the_users_gid_and_groups_under_a_private_parent(
        test_users: tuple[str, ...]) -> None:
    """A child started through as_user has the user's uid, gid and groups (no group root),
    so it reads a file below a 0700 directory made traversable, as a test job under a 0700
    home does."""
    user = test_users[0]
    pw = pwd.getpwnam(user)
    top = Path(tempfile.mkdtemp(prefix="sr-private-"))
    try:
        top.chmod(0o700)
        inner = top / "checkout"
        inner.mkdir(mode=0o755)
        (inner / "data").write_text("readable")
        (inner / "data").chmod(0o644)
        make_traversable(inner)
        out = subprocess.run([PYTHON_SYS, "-I", "-c", _IDENTITY_PROBE, str(inner / "data")],
                             capture_output=True, text=True, timeout=60, check=True,
                             cwd="/", **as_user(user)).stdout.splitlines()
    finally:
        for p in sorted(top.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        top.rmdir()
    groups = sorted(set(os.getgrouplist(user, pw.pw_gid)))
    assert out == [f"{pw.pw_uid} {pw.pw_gid} {groups}", "readable"]
    assert 0 not in groups
