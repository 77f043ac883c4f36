"""Active diagnostics: DCGM's JSON of both schemas judged, the torch memory test's
results measured against expected, and a machine without either says so."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config.health import DiagCheckSection
from slurm_resilience.health.checks import diag as diag_check
from slurm_resilience.health.collectors import cuda_memtest, dcgm
from slurm_resilience.health.collectors import diag as diag_collector
from slurm_resilience.health.findings import Severity

DCGM = REAL_FIXTURES / "dcgm"

FRESH = diag_check.DiagState()  # no clean diagnostic yet


def test_dcgm3_pass_is_a_clean_diagnostic() -> None:
    """(Hand-written: two GPUs, which the real single-GPU captures cannot show.) Every
    result Pass (3.x schema, gpu_ids): one OK finding and the time remembered
    as evidence of a clean diagnostic."""
    report = dcgm.parse_diag(
        (DCGM / "dcgmi-diag-r2-j_dcgm3-schema_h100x2_pass_handwritten.txt").read_text())
    assert report.version == "3.3.5" and report.driver == "550.54.15"
    assert {r.gpu for r in report.results} == {None, 0, 1}
    result = diag_check.check_dcgm(report, FRESH, now=123.0)
    assert [f.severity for f in result.findings] == [Severity.OK]
    assert result.state.last_clean == 123.0


# Real `dcgmi diag -j` captures (tests/fixtures/SOURCES.md section 9): what each says,
# test by test, as (category, test, gpu, status).
VC_DEPLOYMENT = [("Deployment", t, None, "pass") for t in (
    "Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks",
    "Persistence Mode", "Environment Variables", "Page Retirement/Row Remap",
    "Graphics Processes", "Inforom")]
REAL_CAPTURES = {
    "dcgmi-diag-r2-j_dcgm-2x3x_1gpu-16gb_pass_virtualclient.json": [
        *VC_DEPLOYMENT, ("Integration", "PCIe", 0, "pass"),
        ("Hardware", "GPU Memory", 0, "pass")],
    "dcgmi-diag-r3-j_dcgm-2x3x_1gpu-16gb_pass-eud-skip_virtualclient.json": [
        *VC_DEPLOYMENT, ("Integration", "PCIe", 0, "pass"),
        ("Hardware", "GPU Memory", 0, "pass"), ("Hardware", "Diagnostic", 0, "pass"),
        ("Hardware", "EUD Test", 0, "skip"), ("Stress", "Targeted Stress", 0, "pass"),
        ("Stress", "Targeted Power", 0, "pass"), ("Stress", "Memory Bandwidth", 0, "pass")],
}


@pytest.mark.parametrize("name", sorted(REAL_CAPTURES))
def test_real_dcgm3_captures_read_test_by_test_and_pass(name: str) -> None:
    """Two recorded single-GPU runs (levels 2 and 3, 3.x schema): every test, its GPU
    (none for the software tests, which carry no GPU key) and its status as the capture
    says; the one Skip (EUD) among passes does not stop a clean verdict; the document has
    no version and the message does not pretend one."""
    report = dcgm.parse_diag((DCGM / name).read_text())
    assert [(r.category, r.test, r.gpu, r.status) for r in report.results] == REAL_CAPTURES[name]
    assert report.version == "" and report.error is None
    assert all(r.warnings == [] for r in report.results)
    result = diag_check.check_dcgm(report, FRESH, now=7.0)
    assert [(f.severity, f.message) for f in result.findings] == [
        (Severity.OK, f"DCGM diagnostics passed ({len(REAL_CAPTURES[name])} results)")]
    assert result.state.last_clean == 7.0


def test_real_dcgm4_excerpt_names_each_of_eight_gpus() -> None:
    """The 4.x `diagnostic` test as pasted in NVIDIA/DCGM issue #215 (an excerpt: one test
    object of an 8-GPU run, with its trailing comma). The test wraps it in the 4.x
    document around it -- that wrapper is ours, the test object is the capture -- and
    reads eight entity results, GPUs 0-7, all Pass, ``info`` lists ignored."""
    excerpt = (DCGM / "dcgmi-diag-j_dcgm4_8gpu_diagnostic-test-excerpt_dcgm-issue215.txt"
               ).read_text().rstrip().removesuffix(",")
    doc = ('{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": ['
           + excerpt + ']}]}, "metadata": {"version": "4"}}')
    report = dcgm.parse_diag(doc)
    assert [(r.test, r.gpu, r.status) for r in report.results] == [
        ("diagnostic", g, "pass") for g in range(8)]
    assert [f.severity for f in diag_check.check_dcgm(report, FRESH, now=0).findings] == [
        Severity.OK]


def test_dcgm4_test_with_only_a_summary_is_the_nodes_result() -> None:
    """A 4.x test object whose verdict is only in ``test_summary`` (no entity results)
    is still read, as a node-level result; its ``info`` is not a warning."""
    doc = ('{"DCGM Diagnostic": {"test_categories": [{"category": "Deployment", "tests": '
           '[{"name": "software", "results": [], "test_summary": {"status": "Fail", '
           '"info": ["x"], "warnings": [{"warning": "driver mismatch", "error_id": 9}]}}]}]}}')
    report = dcgm.parse_diag(doc)
    assert [(r.test, r.gpu, r.status, r.warnings, r.error_ids) for r in report.results] == [
        ("software", None, "fail", ["driver mismatch"], [9])]
    assert [f.subject for f in diag_check.check_dcgm(report, FRESH, now=0).findings] == ["node"]


def test_dcgm4_memory_fail_names_gpu_test_and_warning() -> None:
    """(Hand-written: no real failing capture with a source was found.) 4.x schema: the
    memory Fail on GPU 1 fails with DCGM's own message; the PCIe Warn
    is a warning; the document survives the JSON hop."""
    report = dcgm.parse_diag(
        (DCGM / "dcgmi-diag-r2-j_dcgm4-schema_h100x2_memory-fail_handwritten.txt").read_text())
    assert report.version == "4.2.3" and report.driver == "570.148.08"
    assert dcgm.from_json(dcgm.to_json(report)) == report
    findings = diag_check.check_dcgm(report, FRESH, now=0).findings
    fails = [f.message for f in findings if f.severity is Severity.FAIL]
    assert fails == ["gpu1 DCGM memory Fail, error 58 MEMORY_MISMATCH: run a field diagnostic: "
                     "GPU 1 A memory mismatch was detected on GPU 1, but no error was reported "
                     "by CUDA or NVML. (expected Pass)"]
    assert [f.subject for f in findings if f.severity is Severity.WARN] == ["gpu1"]
    assert findings[0].data["error_ids"] == [58]


def test_dcgm_that_tested_nothing_is_not_a_pass() -> None:
    """(Hand-written after the excerpt in DCGM issue #139.) Every test skipped (3.x,
    gpu_id key): could not check."""
    report = dcgm.parse_diag(
        (DCGM / "dcgmi-diag-r3-j_dcgm3-schema_t400_all-skipped_handwritten.txt").read_text())
    assert [r.gpu for r in report.results] == [0, 0, 0]
    findings = diag_check.check_dcgm(report, FRESH, now=0).findings
    assert [f.severity for f in findings] == [Severity.UNKNOWN]
    assert "tested nothing" in findings[0].message
    with pytest.raises(dcgm.DcgmParseError):
        dcgm.parse_diag("Error: unable to connect to host engine")


def test_dcgmi_is_run_and_its_failing_exit_status_keeps_the_json(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """A dcgmi on PATH that exits non-zero (as on failed tests) with its JSON: parsed and
    failing; a dcgmi that prints no JSON is "couldn't run", naming what it said."""
    fixture = DCGM / "dcgmi-diag-r2-j_dcgm4-schema_h100x2_memory-fail_handwritten.txt"
    tool = tmp_path / "dcgmi"
    tool.write_text(f"#!/bin/sh\ncat {fixture}\nexit 226\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    snap = diag_collector.collect_json("auto", 2, 30.0, 1 << 20, 1)
    findings = diag_check.check_dcgm(dcgm.from_json(snap["dcgm"]), FRESH, now=0).findings
    assert any(f.severity is Severity.FAIL for f in findings)
    tool.write_text("#!/bin/sh\necho 'Error: unable to establish a connection' >&2\nexit 1\n")
    report = dcgm.collect(2, 30.0)
    assert report.error and "unable to establish a connection" in report.error
    assert diag_check.check_dcgm(report, FRESH, now=0).findings[0].severity is Severity.UNKNOWN


def test_without_dcgm_or_cuda_the_memory_test_says_why(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """No dcgmi and no CUDA (this machine, CI): the torch test does not run and says why,
    which the check turns into "could not check", never a pass."""
    monkeypatch.setenv("PATH", "/nonexistent")
    snap = diag_collector.collect_json("auto", 2, 30.0, 1 << 20, 1)
    report = cuda_memtest.from_json(snap["memtest"])
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: covered by the GPU run")
    assert report.unavailable is not None and "dcgmi not installed" in report.unavailable
    findings = diag_check.check_memtest(report, DiagCheckSection(), FRESH, now=0).findings
    assert [f.severity for f in findings] == [Severity.UNKNOWN]


def test_memtest_measured_against_expected() -> None:
    """Mismatches fail; HBM or host bandwidth under the model's figure fails, naming both;
    a healthy H100 passes."""
    good = cuda_memtest.GpuMemtest(0, "NVIDIA H100 80GB HBM3", 1 << 30, 0, 2600.0, 53.0, 52.0)
    bad = cuda_memtest.GpuMemtest(1, "NVIDIA H100 80GB HBM3", 1 << 30, 3, 1500.0, 22.0, 51.0)
    report = cuda_memtest.MemtestReport([good, bad])
    findings = diag_check.check_memtest(report, DiagCheckSection(), FRESH, now=0).findings
    assert [f.message for f in findings if f.severity is Severity.FAIL] == [
        "gpu1 3 memory mismatches in 1024MiB (expected 0)",
        "gpu1 HBM copy 1500GB/s (expected >=2000 for NVIDIA H100 80GB HBM3)",
        "gpu1 host-to-device 22.0GB/s (expected >=48 for NVIDIA H100 80GB HBM3)"]
    ok = diag_check.check_memtest(cuda_memtest.MemtestReport([good]), DiagCheckSection(),
                                  FRESH, now=5.0)
    assert ok.state.last_clean == 5.0


def test_dcgm_setting_error_names_the_setting_and_fix_with_a_configurable_severity() -> None:
    """(Hand-written to the 4.x schema after the run the issue describes: DCGM 4.2.3 whose
    only failure was error 29.) Persistence mode off is a setting: a warning naming the
    setting and its fix by default, a drain when the site says so; never a hardware
    failure."""
    report = dcgm.parse_diag((DCGM / "dcgmi-diag-r2-j_dcgm4-schema_1gpu_persistence-mode-"
                                      "error29_handwritten.txt").read_text())
    findings = diag_check.check_dcgm(report, FRESH, now=0).findings
    assert [(f.severity, f.subject) for f in findings] == [(Severity.WARN, "gpu0")]
    assert findings[0].message.startswith(
        "gpu0 DCGM software Fail, error 29 PERSISTENCE_MODE: enable persistence mode "
        "(nvidia-smi -pm 1")
    assert findings[0].data["dcgm_kind"] == "setting"
    strict = DiagCheckSection(dcgm_setting_severity="fail")
    assert [f.severity for f in diag_check.check_dcgm(report, FRESH, 0, strict).findings] == [
        Severity.FAIL]


@pytest.mark.parametrize(("error_id", "severity", "expect", "words"), [
    (81, None, Severity.FAIL, "UNCONTAINED_ERROR: drain and reset the GPU, reset required"),
    (85, None, Severity.FAIL, "PENDING_ROW_REMAP: reset the GPU to apply the row remap, "
                              "reset required"),
    (52, None, Severity.FAIL, "FAULTY_MEMORY: run a field diagnostic"),
    (22, None, Severity.UNKNOWN, "CANNOT_OPEN_LIB: fix the DCGM or driver installation"),
    (500, 6, Severity.FAIL, "error 500: drain and reset the GPU, reset required"),
    (501, 5, Severity.WARN, "error 501: fix the configuration DCGM names"),
    (502, None, Severity.FAIL, "error 502: run a field diagnostic"),
])
def test_dcgm_error_ids_decide_the_verdict(error_id: int, severity: int | None,
                                           expect: Severity, words: str) -> None:
    """Each class of DCGM error (reset, hardware, tooling; an unknown id by DCGM's severity,
    else hardware) gives its verdict, with the id and DCGM's advice in the reason. The
    failing result is the real 4.x excerpt's shape with a warning object added."""
    warning: dict[str, object] = {"warning": "x", "error_id": error_id}
    if severity is not None:
        warning["error_severity"] = severity
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
        {"name": "memory", "results": [{"entity_group": "GPU", "entity_group_id": 1,
                                        "entity_id": 3, "status": "Fail",
                                        "warnings": [warning]}]}]}]}}
    import json

    report = dcgm.parse_diag(json.dumps(doc))
    assert dcgm.from_json(dcgm.to_json(report)) == report
    findings = diag_check.check_dcgm(report, FRESH, now=0).findings
    assert [f.severity for f in findings] == [expect]
    assert words in findings[0].message and findings[0].message.endswith("(expected Pass)")
