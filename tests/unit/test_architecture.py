"""Guard rails of the package's layout, read from the source with ``ast``.

* No two-way import between top-level parts (a subpackage or a top-level module of
  ``slurm_resilience``). Every import counts: module level, inside functions (lazy) and
  under ``TYPE_CHECKING``, since each is a dependency a reader has to follow.
* Production code never imports the sandbox, the hardware stand-ins or the testing
  helpers; it reaches a stand-in only through configuration (``health.backend``).
* The code that runs inside the user's job imports no root code.
* No module over 600 lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import slurm_resilience

PACKAGE = Path(slurm_resilience.__file__).parent
NAME = "slurm_resilience"
MAX_LINES = 600

# Parts that exist only for tests and the sandbox; nothing else may import them.
NOT_PRODUCTION = {"sandbox", "fakes", "testing"}

# Parts imported inside the user's training job, and what they may import: never root code
# (the agent's services, the hooks, hang handling, the uploader).
JOB_SIDE = {"heartbeat", "checkpoint"}
JOB_SIDE_MAY_IMPORT = {"heartbeat", "checkpoint", "config", "log", "proc", "safefs", "clock"}
# Single modules of root parts the job side may use: the client end of the agent's socket.
JOB_SIDE_MAY_IMPORT_MODULES = {"slurm_resilience.agent.client"}

# Modules over the limit that another change is splitting right now ("split in progress");
# each name here is a debt with an owner, and the list is emptied when those changes land.
SPLIT_IN_PROGRESS: set[str] = set()  # every module is under the limit now


@dataclass(frozen=True)
class Edge:
    """One import of part ``to`` (module ``target``) by module ``module`` of part
    ``source``."""

    source: str
    to: str
    target: str
    module: str
    line: int


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(dotted: str) -> str | None:
    """The top-level part of a module of the package, or None for one outside it."""
    pieces = dotted.split(".")
    if pieces[0] != NAME or len(pieces) < 2:
        return None
    return pieces[1]


def _is_part(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def _imported(path: Path, module: str | None = None) -> list[tuple[str, int]]:
    """Every module the module at ``path`` imports (with the line), at any depth: module
    level, in functions, under TYPE_CHECKING. ``from pkg import name`` counts ``pkg.name``
    too, since ``name`` may be a submodule."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((source, node.lineno))
            found += [(f"{source}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _edges() -> list[Edge]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _part(module)
        if source is None:  # the package's own __init__
            continue
        for target, line in _imported(path):
            to = _part(target)
            if to is not None and to != source and _is_part(to):
                edges.append(Edge(source, to, target, module, line))
    return edges


def _where(edges: list[Edge], source: str, to: str) -> str:
    return ", ".join(sorted({f"{e.module}:{e.line}" for e in edges
                             if e.source == source and e.to == to}))


def test_no_two_way_import_between_top_level_parts() -> None:
    edges = _edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.source].add(edge.to)
    cycles = [f"{a} <-> {b}: {_where(edges, a, b)} | {_where(edges, b, a)}"
              for a in sorted(graph) for b in sorted(graph[a]) if a < b and a in graph[b]]
    assert not cycles, "two-way imports between top-level parts:\n" + "\n".join(cycles)


def test_production_never_imports_sandbox_stand_ins_or_testing() -> None:
    bad = [f"{e.module}:{e.line} imports {e.to}" for e in _edges()
           if e.to in NOT_PRODUCTION and e.source not in NOT_PRODUCTION]
    assert not bad, ("production code imports test-only parts (reach a stand-in through "
                     "configuration instead):\n" + "\n".join(sorted(set(bad))))


def test_job_side_imports_no_root_code() -> None:
    bad = [f"{e.module}:{e.line} imports {e.to}" for e in _edges()
           if e.source in JOB_SIDE and e.to not in JOB_SIDE_MAY_IMPORT
           and not any(e.target == m or e.target.startswith(m + ".")
                       for m in JOB_SIDE_MAY_IMPORT_MODULES)]
    assert not bad, "code run inside the user's job imports root code:\n" + "\n".join(
        sorted(set(bad)))


def test_modules_stay_under_the_line_limit() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    over = sorted(f"{name}: {n} lines" for name, n in sizes.items()
                  if n > MAX_LINES and name not in SPLIT_IN_PROGRESS)
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(over)


def test_the_allow_list_names_only_modules_still_over_the_limit() -> None:
    """A split that landed must leave the list, so the list never hides a new module."""
    stale = sorted(name for name in SPLIT_IN_PROGRESS if (PACKAGE / name).is_file()
                   and len((PACKAGE / name).read_text().splitlines()) <= MAX_LINES)
    assert not stale, f"under {MAX_LINES} lines now, drop from SPLIT_IN_PROGRESS: {stale}"


def test_the_guard_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from slurm_resilience.hang import policy\n"
        "def f():\n    from slurm_resilience.metrics import service\n"
        "    from ..transport import wire\n")
    names = {n for n, _ in _imported(source, "slurm_resilience.stragglers.mod")}
    assert {"slurm_resilience.hang.policy", "slurm_resilience.metrics.service",
            "slurm_resilience.transport.wire"} <= names
