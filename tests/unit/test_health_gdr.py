"""GPUDirect RDMA loopback per HCA: ib_write_bw's real output formats read, the check
measured against the link rate's figure, a missing perftest is "could not check"."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import GdrCheckSection
from slurm_resilience.health.checks import gdr
from slurm_resilience.health.checks.spec import NoState
from slurm_resilience.health.collectors import perftest
from slurm_resilience.health.findings import Severity

PERFTEST = REAL_FIXTURES / "perftest"
PASS = PERFTEST / "ib_write_bw_client_use-cuda_report-gbits_ndr-pass.txt"
SLOW = PERFTEST / "ib_write_bw_client_use-cuda_report-gbits_ndr-slow.txt"
HOST = PERFTEST / "ib_write_bw_client_host-memory_mib-per-sec.txt"


def test_every_unit_of_the_table_is_read_in_gbps() -> None:
    assert perftest.parse_bw(PASS.read_text()) == 371.79
    assert perftest.parse_bw(SLOW.read_text()) == 311.4
    assert perftest.parse_bw(HOST.read_text()) == pytest.approx(197.72, abs=0.01)
    assert perftest.parse_bw(HOST.read_text().replace("MiB/sec", "MB/sec")) == \
        pytest.approx(188.56, abs=0.01)
    with pytest.raises(perftest.PerftestParseError):
        perftest.parse_bw(" Couldn't connect to localhost:18515\nUnable to open file descriptor "
                          "for socket connection\n")
    assert perftest.link_gbps("400 Gb/sec (4X NDR)") == 400.0


def sysfs(tmp_path: Path, hcas: dict[str, str]) -> Path:
    root = tmp_path / "infiniband"
    for hca, rate in hcas.items():
        port = root / hca / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(rate + "\n")
    return root


def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ib_write_bw on PATH: the server waits for its client's test, then ends (as the real
    one does); the client refuses once (server not listening yet), then prints the
    recorded run of its HCA."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    tool = bin_dir / "ib_write_bw"
    tool.write_text(f"""#!/bin/sh
for a in "$@"; do last="$a"; done
if [ "$last" != localhost ]; then
  while [ ! -e {tmp_path}/tested-$2 ]; do sleep 0.05; done
  exit 0
fi
echo "$@" >> {calls}
if [ ! -e {tmp_path}/listening-$2 ]; then
  touch {tmp_path}/listening-$2
  echo " Couldn't connect to localhost:$4" >&2
  exit 1
fi
case "$2" in mlx5_0) cat {PASS};; mlx5_3) cat {SLOW};; esac
touch {tmp_path}/tested-$2
""")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_a_slow_hca_fails_measured_against_its_link_rate(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two NDR HCAs, two GPUs: each loopback pair uses its GPU's memory; mlx5_3 at 311 Gb/s
    fails against 360, mlx5_0 passes."""
    calls = stand_in(tmp_path, monkeypatch)
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).touch()
    root = sysfs(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)", "mlx5_3": "400 Gb/sec (4X NDR)"})
    snap = perftest.collect(str(root), args=["-s", "8388608"], port=18515, timeout=30,
                            gpu_by_hca={}, dev=str(dev))
    snap = perftest.PerftestSnapshot.from_json(snap.to_json())
    assert [(r.hca, r.gpu, r.gbps) for r in snap.results] == [("mlx5_0", 0, 371.79),
                                                               ("mlx5_3", 1, 311.4)]
    assert "-d mlx5_3 -p 18516 --report_gbits -s 8388608 --use_cuda=1 localhost" in \
        calls.read_text()
    findings = gdr.check(snap, GdrCheckSection(), NoState()).findings
    assert [(f.severity, f.message) for f in findings] == [
        (Severity.OK, "mlx5_0 loopback 371.79Gb/s (gpu0)"),
        (Severity.FAIL, "mlx5_3 GPUDirect RDMA loopback 311.4Gb/s (gpu1; expected >=360)")]


def test_without_perftest_it_is_could_not_check(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    root = sysfs(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    snap = perftest.collect(str(root), args=[], port=18515, timeout=30, gpu_by_hca={})
    findings = gdr.check(snap, GdrCheckSection(), NoState()).findings
    assert [(f.severity, f.message) for f in findings] == [
        (Severity.UNKNOWN, "GPUDirect RDMA loopback not measured: ib_write_bw (perftest) "
                           "not installed")]
    unmeasured = perftest.PerftestSnapshot(results=[
        perftest.HcaBandwidth("mlx5_1", 400.0, None, None, "exit without a result: x"),
        perftest.HcaBandwidth("mlx5_2", 25.0, None, 20.0)])
    assert [f.severity for f in gdr.check(unmeasured, GdrCheckSection(), NoState()).findings] == [
        Severity.UNKNOWN, Severity.UNKNOWN]


def test_the_gate_runs_it_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """`check --only gdr` runs it (here: perftest missing, reported, not drained by
    default); a prolog never does."""
    from slurm_resilience.config import Config, load_text
    from slurm_resilience.health import gate

    monkeypatch.setenv("PATH", str(tmp_path))
    root = sysfs(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    cfg = load_text(Config, f"node: {{state_dir: {tmp_path}/state}}\n"
                            f"health:\n  infiniband: {{sysfs_root: {root}}}\n")
    report = gate.run(cfg, "n1", "manual", only=("gdr",))
    assert report.verdict.healthy
    assert [(f.check, f.severity) for f in report.findings] == [("gdr", Severity.UNKNOWN)]
    assert "gdr" not in gate.run(cfg, "n1", "prolog").seconds


def test_a_server_that_cannot_start_is_named(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """perftest built without CUDA: the server exits at once; the HCA is "not measured",
    with the server's own words, never a pass."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "ib_write_bw"
    tool.write_text("""#!/bin/sh
for a in "$@"; do last="$a"; done
if [ "$last" != localhost ]; then
  echo "CUDA support is not enabled in this perftest build" >&2
  exit 1
fi
echo " Couldn't connect to localhost:18515" >&2
exit 1
""")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    root = sysfs(tmp_path, {"mlx5_0": "400 Gb/sec (4X NDR)"})
    snap = perftest.collect(str(root), args=[], port=18515, timeout=30, gpu_by_hca={"mlx5_0": 0})
    findings = gdr.check(snap, GdrCheckSection(), NoState()).findings
    assert [(f.severity, f.message) for f in findings] == [
        (Severity.UNKNOWN, "mlx5_0 loopback (gpu0) not measured: server exited 1: CUDA "
                           "support is not enabled in this perftest build")]
