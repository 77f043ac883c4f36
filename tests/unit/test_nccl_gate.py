"""Judging attempts, retries, planning from the driver's GPU list, and a real gloo gate run."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from conftest import REAL_FIXTURES

from slurm_resilience.config import Config, load_text
from slurm_resilience.config.nccl import NcclSection, NcclThreshold
from slurm_resilience.nccl import cache, faults, gate
from slurm_resilience.nccl.launcher import Attempt, LaunchSpec, RankOutcome

MIB = 1024**2


def attempt(status: str = "ok", detail: str = "", seconds: tuple[float, ...] = (1e-3, 2e-3)
            ) -> Attempt:
    ranks = tuple(
        RankOutcome(i, 0, {"label": f"rank{i}", "results": [
            {"size": MIB, "seconds": s, "mismatches": 0}]})
        for i, s in enumerate(seconds))
    return Attempt(status, detail, 1.0, ranks)  # type: ignore[arg-type]


def section(text: str) -> NcclSection:
    return load_text(Config, text).nccl


CPU = NcclThreshold("cpu", 2, 0.4, MIB)  # type: ignore[arg-type]


def test_judge_uses_the_slowest_rank() -> None:
    """busbw comes from the slowest rank: 1 MiB in 2 ms over 2 ranks is 0.524 GB/s."""
    j = gate.judge(attempt(), CPU, "intra-node")
    assert j.verdict == "pass"
    assert j.busbw[MIB] == MIB / 2e-3 / 1e9
    assert j.reason == "nccl allreduce 0.524 GB/s >= 0.4 (2xcpu, 1MiB)"


def test_judge_slow_names_measured_against_expected() -> None:
    """Below the threshold: fail with measured < expected, model and size."""
    j = gate.judge(attempt(seconds=(1e-3, 4e-3)), CPU, "intra-node")
    assert (j.verdict, j.kind) == ("fail", "slow")
    assert j.reason == "nccl allreduce 0.262 GB/s < 0.4 (2xcpu, 1MiB)"


def test_judge_failures_have_their_own_reasons() -> None:
    """Wrong sum, timeout and crash each give the drain reason the issue asks for."""
    assert gate.judge(attempt("wrong", "gpu5"), CPU, "intra-node").reason == \
        "nccl allreduce wrong result on gpu5"
    assert gate.judge(attempt("timeout", "timed out after 120s"), CPU, "intra-node").reason == \
        "nccl test timed out after 120s"
    assert gate.judge(attempt("timeout", "timed out after 120s"), CPU, "ib-loopback").reason \
        == "nccl ib-loopback test timed out after 120s"
    crashed = gate.judge(attempt("crashed", "rank 3 exited 1 in init: NCCL error"), CPU,
                         "intra-node")
    assert (crashed.verdict, crashed.reason) == (
        "fail", "nccl test failed: rank 3 exited 1 in init: NCCL error")
    unknown = gate.judge(attempt("unavailable", "rank 0: no torch"), CPU, "intra-node")
    assert unknown.verdict == "unknown"


def test_no_threshold_checks_the_sum_and_reports_the_rate() -> None:
    """Without a threshold for the node, a correct result passes and says so."""
    j = gate.judge(attempt(), None, "intra-node")
    assert j.verdict == "pass" and j.kind == "no-threshold"
    assert "no threshold configured" in j.reason


def real_one_gpu_attempt() -> Attempt:
    """The attempt of the real one-GPU run (NCCL 2.28.9 on one H200; SOURCES.md section
    11): its rank's report as nccl-test.json recorded it."""
    run = json.loads((REAL_FIXTURES / "gpu-capture" / "h200-1gpu-vm_drv580.159.04" /
                      "nccl-test.json").read_text())
    recorded = json.loads(run["stdout"])["variants"][0]["attempts"][0]
    ranks = tuple(RankOutcome(int(r.pop("rank")), r.pop("returncode"), r)
                  for r in recorded["ranks"])
    return Attempt(recorded["status"], recorded["detail"], recorded["seconds"], ranks)


def test_one_rank_passes_on_correctness_and_claims_no_bandwidth() -> None:
    """With one rank (the real one-GPU H200 run) bus bandwidth is 0 by definition: the
    verdict passes on the checked result alone, with its own kind, says that bandwidth
    can't be measured, and records and prints no GB/s, even where a threshold for one GPU
    is configured."""
    one = real_one_gpu_attempt()
    assert len(one.ranks) == 1 and one.ranks[0].report["device_name"] == "NVIDIA H200"
    j = gate.judge(one, None, "intra-node")
    assert (j.verdict, j.kind, j.busbw, j.expected_gbps) == ("pass", "single-rank", {}, None)
    assert j.reason == ("nccl allreduce on 1 GPU: result correct at 256MiB to 4GiB; "
                        "bandwidth not measurable with one rank (no GPU-to-GPU path)")
    h200 = NcclThreshold("H200", 1, 300.0, 4 << 30)  # type: ignore[arg-type]
    j = gate.judge(one, h200, "intra-node")
    assert (j.verdict, j.kind) == ("pass", "single-rank") and "GB/s" not in j.reason
    assert j.reason.endswith("; the 1xH200 threshold is not applied")
    doc = gate.VariantResult("intra-node", j, (one,)).to_json()
    assert doc["busbw_gbps"] == {} and doc["kind"] == "single-rank"
    wrong = Attempt("wrong", "gpu0", 1.0, one.ranks)
    assert gate.judge(wrong, None, "intra-node").reason == "nccl allreduce wrong result on gpu0"


def fake_launch(statuses: list[str]) -> tuple[gate.Launch, list[LaunchSpec]]:
    calls: list[LaunchSpec] = []

    def launch(spec: LaunchSpec, stop: threading.Event | None) -> Attempt:
        calls.append(spec)
        status = statuses[len(calls) - 1]
        return attempt(status, "rank1" if status == "wrong" else "timed out after 3s")

    return launch, calls


def test_one_retry_then_pass() -> None:
    """A failed first attempt is retried once; a passing retry passes."""
    launch, calls = fake_launch(["timeout", "ok"])
    spec = LaunchSpec(2, "gloo", (MIB,), 3.0)
    r = gate.run_variant(spec, CPU, "intra-node", retries=1, launch=launch)
    assert len(calls) == 2 and r.judgement.verdict == "pass"


def test_one_retry_then_fail_with_the_last_reason() -> None:
    """Two failures in a row fail with the last attempt's reason; no third attempt."""
    launch, calls = fake_launch(["wrong", "wrong", "ok"])
    spec = LaunchSpec(2, "gloo", (MIB,), 3.0)
    r = gate.run_variant(spec, CPU, "intra-node", retries=1, launch=launch)
    assert len(calls) == 2
    assert r.judgement.reason == "nccl allreduce wrong result on rank1"


def test_slow_is_retried_too() -> None:
    """A slow attempt counts as failed for the retry."""
    calls: list[int] = []

    def launch(spec: LaunchSpec, stop: threading.Event | None) -> Attempt:
        calls.append(1)
        return attempt(seconds=(1e-3, 9e-3) if len(calls) == 1 else (1e-3, 1e-3))

    r = gate.run_variant(LaunchSpec(2, "gloo", (MIB,), 3.0), CPU, "intra-node", 1,
                         launch=launch)
    assert len(calls) == 2 and r.judgement.verdict == "pass"


def test_ib_loopback_variant_sets_its_environment() -> None:
    """ib-loopback turns off SHM and P2P and sets the GPUDirect level; intra-node doesn't."""
    s = section("nccl:\n  variants: [intra-node, ib-loopback]\n"
                "  extra_env: {NCCL_DEBUG: WARN}\n")
    p = gate.Plan(8, "NVIDIA H100 80GB HBM3")
    ib = gate.spec_for(s, p, "ib-loopback", timeout_s=5, nice=0, fault_file="")
    intra = gate.spec_for(s, p, "intra-node", timeout_s=5, nice=0, fault_file="")
    assert ib.env == {"NCCL_DEBUG": "WARN", "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
                      "NCCL_NET_GDR_LEVEL": "SYS"}
    assert intra.env == {"NCCL_DEBUG": "WARN"}


def test_plan_counts_gpus_and_reads_the_model_from_the_driver(tmp_path: Path) -> None:
    """processes 0 and no model: one rank per /proc/driver/nvidia/gpus entry, model from it."""
    for i, bus in enumerate(("0000:19:00.0", "0000:2d:00.0")):
        d = tmp_path / bus
        d.mkdir()
        (d / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 1{i}\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {i}\n")
    p = gate.plan(NcclSection(), str(tmp_path))
    assert p == gate.Plan(2, "NVIDIA H100 80GB HBM3")


def test_plan_without_gpus_cannot_check(tmp_path: Path) -> None:
    """No GPU and no configured count: the gate result is 'unknown', not a failure."""
    result = gate.run_gate(NcclSection(), gpu_root=str(tmp_path))
    assert result.verdict == "unknown"
    assert "no GPUs found" in result.reasons[0]


def test_fingerprint_changes_with_the_thresholds() -> None:
    """A result measured under other thresholds is not reused."""
    a = section("nccl:\n  backend: gloo\n  processes: 2\n")
    b = section("nccl:\n  backend: gloo\n  processes: 2\n  thresholds: []\n")
    assert cache.fingerprint(a) != cache.fingerprint(b)
    assert cache.fingerprint(a) == cache.fingerprint(section("nccl:\n  backend: gloo\n"
                                                           "  processes: 2\n"))


GLOO = ("nccl:\n  enabled: true\n  backend: gloo\n  processes: 2\n  sizes: [64KiB]\n"
        "  warmup_iters: 1\n  iters: 3\n  timeout_s: 30\n  thresholds:\n"
        "    - {model: cpu, gpus: 2, size: 64KiB, min_busbw_gbps: %s}\n")


def test_real_gloo_gate_passes_and_a_raised_threshold_fails(tmp_path: Path) -> None:
    """Real ranks: a reachable threshold passes; one far above what this machine can do
    fails (after its retry) with measured < expected."""
    ok = gate.run_gate(section(GLOO % "0.0001"))
    assert ok.verdict == "pass", ok.reasons
    assert ok.reasons[0].startswith("nccl allreduce ")
    assert ok.reasons[0].endswith(">= 0.0001 (2xcpu, 64KiB)")
    slow = gate.run_gate(section(GLOO % "10000"))
    assert slow.verdict == "fail"
    assert len(slow.variants[0].attempts) == 2
    assert slow.reasons[0].endswith(" GB/s < 10000 (2xcpu, 64KiB)")


def test_real_gloo_gate_slow_fault_drops_the_bandwidth(tmp_path: Path) -> None:
    """An injected slow rank makes the measured rate fall below a threshold it met."""
    fault = str(tmp_path / "fault.json")
    faults.write(fault, faults.Fault("slow", 1, 0.05))
    slow = gate.run_gate(section(GLOO % "0.01"), fault_file=fault)
    assert slow.verdict == "fail"
    assert " < 0.01 (2xcpu, 64KiB)" in slow.reasons[0]


def test_nccl_backend_without_a_cuda_torch_cannot_check() -> None:
    """backend nccl with a CPU-only torch (this machine): the ranks say so and the gate
    answers 'could not check' instead of draining the node."""
    s = section("nccl:\n  backend: nccl\n  processes: 2\n  gpu_model: H100\n  sizes: [1MiB]\n"
                "  timeout_s: 60\n")
    result = gate.run_gate(s)
    assert result.verdict == "unknown", result.reasons
    assert "has no CUDA/NCCL support" in result.reasons[0]
    assert len(result.variants[0].attempts) == 1  # nothing to retry
