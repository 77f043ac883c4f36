"""Shared filesystem reachability: answered, unmounted, missing and hung paths."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from slurm_resilience.config.health import MountsCheckSection
from slurm_resilience.health.checks import mounts as mounts_check
from slurm_resilience.health.checks.spec import NoState
from slurm_resilience.health.collectors import mounts
from slurm_resilience.health.findings import Severity


def _hangs_on_stuck(path: str) -> dict[str, Any]:
    """A server that never answers: the child blocks as stat on a dead NFS mount would."""
    if path.endswith("stuck"):
        signal.pause()
    return mounts._probe(path)


def test_reachable_unmounted_missing_and_hung_paths(tmp_path: Path) -> None:
    """/ answers and is a mount point; a plain directory is not mounted; a missing path is
    unreachable; a hung one fails on the timeout while the others still answer."""
    stuck = str(tmp_path / "stuck")
    os.mkdir(stuck)
    paths = ["/", str(tmp_path), str(tmp_path / "missing"), stuck]
    # The stuck probe takes the whole timeout; the others must answer within it even on a
    # loaded machine (0.5 s was not always enough for a forked child to stat /).
    snap = mounts.collect(paths, 5.0, probe=_hangs_on_stuck)
    assert mounts.MountsSnapshot.from_json(snap.to_json()) == snap
    cfg = MountsCheckSection(paths=tuple(paths), timeout_s=5.0)
    findings = mounts_check.check(snap, cfg, NoState()).findings
    by_path = {f.subject: f for f in findings}
    assert by_path["/"].severity is Severity.OK
    assert by_path[str(tmp_path)].message == f"{tmp_path} not mounted (expected a mount point)"
    assert by_path[str(tmp_path / "missing")].message == (
        f"{tmp_path / 'missing'} unreachable: No such file or directory (expected reachable)")
    assert by_path[stuck].message == f"{stuck} no answer in 5s (expected reachable)"
    assert all(f.severity is Severity.FAIL for p, f in by_path.items() if p != "/")
    relaxed = MountsCheckSection(paths=tuple(paths), require_mountpoint=False)
    assert mounts_check.check(snap, relaxed, NoState()).findings[1].severity is Severity.OK
