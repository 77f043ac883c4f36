"""NVMe / staging disk: collector on a real directory, SMART parsing of real captures, check."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from conftest import REAL_FIXTURES

from slurm_resilience.config.health import NvmeCheckSection
from slurm_resilience.health.checks import nvme as nvme_check
from slurm_resilience.health.checks.spec import NoState
from slurm_resilience.health.collectors import nvme as collector
from slurm_resilience.health.findings import Severity

NVME = REAL_FIXTURES / "nvme"


def run(snap: collector.NvmeSnapshot | dict[str, Any], cfg: NvmeCheckSection | None = None
        ) -> list[Any]:
    """Check a snapshot, given typed or as the JSON the collector child sends."""
    typed = collector.NvmeSnapshot.from_json(snap) if isinstance(snap, dict) else snap
    assert collector.NvmeSnapshot.from_json(typed.to_json()) == typed
    return nvme_check.check(typed, cfg or NvmeCheckSection(min_free=1 << 20), NoState()).findings


def fails(findings: list[Any]) -> list[str]:
    return [f.message for f in findings if f.severity is Severity.FAIL]


def test_writable_directory_with_space_passes(tmp_path: Path) -> None:
    """A writable directory with free space passes, with a write+fsync probe time."""
    snap = collector.collect(str(tmp_path), smart=False)
    assert snap.exists and snap.probe_ms is not None and snap.probe_error is None
    assert not fails(run(snap))
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_missing_directory_fails(tmp_path: Path) -> None:
    """A staging path that does not exist fails."""
    assert fails(run(collector.collect(str(tmp_path / "nope")))) == [
        f"nvme {tmp_path / 'nope'} missing (expected a directory)"]


def test_not_a_mount_point_fails_when_required(tmp_path: Path) -> None:
    """With require_mountpoint a plain directory fails (the disk did not mount)."""
    snap = collector.collect(str(tmp_path), active=False)
    cfg = NvmeCheckSection(require_mountpoint=True, min_free=0)
    assert fails(run(snap, cfg)) == [f"nvme {tmp_path} not mounted (expected a mount point)"]


def test_full_disk_fails_using_the_size_limit(tmp_path: Path) -> None:
    """Files filling the configured size leave less than min_free: a failure with sizes."""
    with open(tmp_path / "fill", "wb") as fh:
        fh.truncate(95 << 30)  # sparse: apparent size counts, no disk used
    snap = collector.collect(str(tmp_path), size_limit=100 << 30, active=False)
    assert snap.free == 5 << 30
    assert fails(run(snap, NvmeCheckSection(min_free=10 << 30))) == [
        "nvme 5.0GiB free of 100.0GiB (expected >=10.0GiB)"]
    assert not fails(run(snap, NvmeCheckSection(min_free=4 << 30)))


def test_unwritable_directory_fails(tmp_path: Path) -> None:
    """A probe that cannot create its file fails (read-only or broken disk)."""
    snap = {"path": str(tmp_path), "exists": True, "error": None, "free": 1 << 40,
            "total": 1 << 41, "probe_ms": None,
            "probe_error": f"couldn't create a file in {tmp_path}: Read-only file system"}
    assert fails(run(snap)) == [f"nvme couldn't create a file in {tmp_path}: "
                                "Read-only file system"]


def test_slow_probe_warns() -> None:
    """A write+fsync slower than max_probe_ms is a warning."""
    snap = {"path": "/x", "exists": True, "error": None, "free": 1 << 40, "total": 1 << 41,
            "probe_ms": 900.0}
    findings = run(snap)
    assert [f.severity for f in findings] == [Severity.WARN]


def test_smart_logs_of_real_drives_parse() -> None:
    """critical_warning, percentage_used and media_errors come out of real smartctl JSON."""
    got = {p.name: collector.parse_smart(p.read_text()) for p in sorted(NVME.glob("*.json"))}
    assert got["smartctl-a-json_nvme_sabrent-rocket4-1tb_healthy.json"].critical_warning == 0
    assert got["smartctl-x-j_nvme_samsung-970evo_media-errors.json"].media_errors == 7
    assert got["smartctl-a-j_nvme_corsair-force-mp510_err-log-entries.json"] \
        .percentage_used == 1
    nvme_cli = '{"critical_warning": 4, "temperature": 310, "percent_used": 3}'
    assert collector.parse_smart(nvme_cli) == collector.SmartLog(critical_warning=4,
                                                                 percentage_used=3)


def test_smart_media_errors_and_spare_are_judged() -> None:
    """The real drive with 7 media errors (smartctl still says passed) fails; spare below
    the drive's threshold fails; nvme-cli's key names are read too."""
    base = {"path": "/x", "exists": True, "error": None, "free": 1 << 40, "total": 1 << 41}
    worn = collector.parse_smart(
        (NVME / "smartctl-x-j_nvme_samsung-970evo_media-errors.json").read_text())
    assert fails(run({**base, "smart": asdict(worn)})) == [
        "nvme 7 media errors (expected <=0)"]
    assert not fails(run({**base, "smart": asdict(worn)}, NvmeCheckSection(min_free=1 << 20,
                                                                   max_media_errors=-1)))
    low = collector.parse_smart('{"critical_warning": 0, "avail_spare": 4, "spare_thresh": 10,'
                                ' "media_errors": 0, "percent_used": 50}')
    assert fails(run({**base, "smart": asdict(low)})) == [
        "nvme 4% available spare (expected >=10%)"]


def test_smart_critical_warning_and_wear_fail() -> None:
    """A critical warning or endurance used past the limit fails; a healthy log passes."""
    base = {"path": "/x", "exists": True, "error": None, "free": 1 << 40, "total": 1 << 41}
    healthy = collector.parse_smart(
        (NVME / "smartctl-a-json_nvme_sabrent-rocket4-1tb_healthy.json").read_text())
    assert not fails(run({**base, "smart": asdict(healthy)}))
    assert fails(run({**base, "smart": {"critical_warning": 4, "percentage_used": 3}})) == [
        "nvme critical warning 0x04 (expected 0)"]
    assert fails(run({**base, "smart": {"critical_warning": 0, "percentage_used": 99}})) == [
        "nvme 99% endurance used (expected <=95%)"]


def _descend(root: Path, depth: int) -> int:
    """A descriptor of the directory ``depth`` levels of "d" below ``root`` (none held above)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd


def test_a_tree_deeper_than_recursion_and_path_max_is_counted(tmp_path: Path) -> None:
    """6,000 nested directories (a path far past PATH_MAX) are walked without recursion,
    every file counted once and a symlink out of the tree not followed."""
    depth = 6000
    (tmp_path / "outside").write_bytes(b"x" * 4096)
    root = tmp_path / "nvme"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for level in range(depth):
        with open(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd), "wb") as fh:
            fh.write(b"y" * (level % 3))
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.symlink(tmp_path, "up", dir_fd=fd)
    big = os.open("big", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
    os.ftruncate(big, 95 << 30)  # sparse: its apparent size counts
    os.close(big)
    os.close(fd)
    try:
        snap = collector.collect(str(root), size_limit=100 << 30, active=False)
        assert snap.free == (5 << 30) - sum(level % 3 for level in range(depth))
    finally:  # pytest's own cleanup recurses: take the tree down from the bottom
        fd = _descend(root, depth)
        os.unlink("up", dir_fd=fd)
        os.unlink("big", dir_fd=fd)
        for _ in range(depth):
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir("d", dir_fd=fd)
            os.unlink("f", dir_fd=fd)
        os.close(fd)
