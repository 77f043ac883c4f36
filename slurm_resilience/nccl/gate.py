"""The whole NCCL test of one node: plan, run each variant with its retry, judge.

gather (ranks' reports) -> pure judgement (:func:`judge`) -> a :class:`GateResult`
that the cache stores and the hook steps turn into drains. Nothing here imports
torch or calls Slurm.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from slurm_resilience.config.nccl import NcclSection, NcclThreshold
from slurm_resilience.log import get_logger
from slurm_resilience.nccl import bandwidth
from slurm_resilience.nccl.cache import ResultDoc, VariantDoc, Verdict, fingerprint
from slurm_resilience.nccl.launcher import Attempt, LaunchSpec, run_once

log = get_logger("nccl")

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


class PlanError(Exception):
    """The test cannot be set up on this node (no GPUs, no model): "could not check"."""


def local_gpu_models(root: str = NVIDIA_GPUS) -> list[str]:
    """The model of each GPU the driver knows, from ``<root>/<pci>/information``
    (``Model:  NVIDIA H100 80GB HBM3``), in PCI order: no NVML or torch needed."""
    models = []
    for info in sorted(glob.glob(os.path.join(root, "*", "information"))):
        with open(info, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "Model":
                    models.append(value.strip())
                    break
            else:
                models.append("")
    return models


@dataclass(frozen=True)
class Plan:
    ranks: int
    model: str


def plan(section: NcclSection, gpu_root: str = NVIDIA_GPUS) -> Plan:
    """How many ranks and which model: config first, then the driver."""
    if section.backend == "gloo":
        if section.processes < 1:
            raise PlanError("nccl.processes must be set (>= 1) for the gloo backend")
        return Plan(section.processes, section.gpu_model or "cpu")
    models = local_gpu_models(gpu_root) if (not section.processes or not section.gpu_model) \
        else []
    ranks = section.processes or len(models)
    if ranks < 1:
        raise PlanError(f"no GPUs found under {gpu_root} and nccl.processes is 0")
    model = section.gpu_model or (models[0] if models else "")
    if not model:
        raise PlanError(f"couldn't read the GPU model under {gpu_root}; set nccl.gpu_model")
    return Plan(ranks, model)


def measurements(attempt: Attempt) -> list[bandwidth.Measurement]:
    """Per size, the slowest rank's time."""
    per_size: dict[int, list[float]] = {}
    for r in attempt.ranks:
        for item in r.report.get("results", ()):
            per_size.setdefault(int(item["size"]), []).append(float(item["seconds"]))
    n = len(attempt.ranks)
    return [bandwidth.Measurement(size, bandwidth.slowest(times), n)
            for size, times in sorted(per_size.items())]


def _what(variant: str) -> str:
    return "nccl" if variant == "intra-node" else f"nccl {variant}"


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    kind: str
    reason: str
    busbw: dict[int, float] = field(default_factory=dict)
    expected_gbps: float | None = None


def judge(attempt: Attempt, threshold: NcclThreshold | None, variant: str) -> Judgement:
    """Pure: an attempt and its threshold -> pass/fail/unknown with the drain reason."""
    what = _what(variant)
    if attempt.status == "aborted":
        return Judgement("aborted", "aborted", attempt.detail)
    if attempt.status == "unavailable":
        return Judgement("unknown", "unavailable", f"{what} test could not run: {attempt.detail}")
    if attempt.status == "wrong":
        return Judgement("fail", "wrong", f"{what} allreduce wrong result on {attempt.detail}")
    if attempt.status == "timeout":
        return Judgement("fail", "timeout", f"{what} test {attempt.detail}")
    if attempt.status == "crashed":
        return Judgement("fail", "crashed", f"{what} test failed: {attempt.detail}")
    ms = measurements(attempt)
    busbw = {m.size: m.busbw for m in ms}
    if not ms:
        return Judgement("fail", "crashed", f"{what} test failed: no rank reported a time")
    if len(attempt.ranks) == 1:
        return _single_rank(ms, threshold, what)
    if threshold is None:
        top = max(ms, key=lambda m: m.size)
        return Judgement("pass", "no-threshold",
                         f"{what} allreduce {bandwidth.fmt_gbps(top.busbw)} GB/s at "
                         f"{bandwidth.fmt_size(top.size)}: no threshold configured", busbw)
    cmp = bandwidth.compare(ms, threshold, variant)
    return Judgement("pass" if cmp.ok else "fail", "ok" if cmp.ok else "slow", cmp.reason, busbw,
                     threshold.min_busbw_gbps)


def _single_rank(ms: Sequence[bandwidth.Measurement], threshold: NcclThreshold | None,
                 what: str) -> Judgement:
    """One rank (a one-GPU node): its all_reduce result was checked element by element,
    but there is no GPU-to-GPU path to time. Bus bandwidth is 0 by definition (2(n-1)/n),
    so no bandwidth is recorded or compared: the pass is for correctness only."""
    sizes = sorted(m.size for m in ms)
    at = bandwidth.fmt_size(sizes[0]) if len(sizes) == 1 else \
        f"{bandwidth.fmt_size(sizes[0])} to {bandwidth.fmt_size(sizes[-1])}"
    ignored = f"; the {threshold.gpus}x{threshold.model} threshold is not applied" \
        if threshold is not None else ""
    return Judgement("pass", "single-rank",
                     f"{what} allreduce on 1 GPU: result correct at {at}; bandwidth not "
                     f"measurable with one rank (no GPU-to-GPU path){ignored}")


@dataclass(frozen=True)
class VariantResult:
    variant: str
    judgement: Judgement
    attempts: tuple[Attempt, ...]

    def to_json(self) -> VariantDoc:
        j = self.judgement
        return {
            "variant": self.variant, "verdict": j.verdict, "kind": j.kind, "reason": j.reason,
            "busbw_gbps": {str(k): round(v, 4) for k, v in j.busbw.items()},
            "expected_gbps": j.expected_gbps,
            "attempts": [a.to_json() for a in self.attempts],
        }


@dataclass(frozen=True)
class GateResult:
    """Everything the cache keeps and the hooks act on."""

    verdict: Verdict
    reasons: tuple[str, ...]
    model: str
    ranks: int
    backend: str
    seconds: float
    fingerprint: str
    variants: tuple[VariantResult, ...] = ()
    finished_at: float = 0.0

    def to_json(self) -> ResultDoc:
        return {
            "verdict": self.verdict, "reasons": list(self.reasons), "model": self.model,
            "ranks": self.ranks, "backend": self.backend, "seconds": round(self.seconds, 3),
            "fingerprint": self.fingerprint, "finished_at": self.finished_at,
            "variants": [v.to_json() for v in self.variants],
        }


def spec_for(section: NcclSection, p: Plan, variant: str, *, timeout_s: float, nice: int,
             fault_file: str) -> LaunchSpec:
    env = dict(section.extra_env)
    if variant == "ib-loopback":
        env.update(section.ib_loopback_env)
    return LaunchSpec(
        ranks=p.ranks, backend=section.backend, sizes=tuple(int(s) for s in section.sizes),
        timeout_s=timeout_s, warmup=section.warmup_iters, iters=section.iters, env=env,
        fault_file=fault_file, python=section.python, nice=nice,
    )


Launch = Callable[[LaunchSpec, threading.Event | None], Attempt]


def run_variant(spec: LaunchSpec, threshold: NcclThreshold | None, variant: str, retries: int,
                stop: threading.Event | None = None, launch: Launch = run_once
                ) -> VariantResult:
    """One variant with its retries: a failed attempt (wrong, slow, hung, crashed) is
    tried again ``retries`` times; the last attempt decides."""
    attempts: list[Attempt] = []
    while True:
        attempt = launch(spec, stop)
        attempts.append(attempt)
        j = judge(attempt, threshold, variant)
        if j.verdict != "fail" or len(attempts) > retries:
            return VariantResult(variant, j, tuple(attempts))
        log.warning("nccl attempt failed, retrying", variant=variant, reason=j.reason,
                    attempt=len(attempts))


def combine(results: Sequence[VariantResult]) -> tuple[Verdict, tuple[str, ...]]:
    """Aborted beats everything (no result); then fail; then unknown; else pass."""
    verdicts = [r.judgement.verdict for r in results]
    if "aborted" in verdicts:
        return "aborted", ("aborted: a job arrived",)
    fails = tuple(r.judgement.reason for r in results if r.judgement.verdict == "fail")
    if fails:
        return "fail", fails
    unknown = tuple(r.judgement.reason for r in results if r.judgement.verdict == "unknown")
    if unknown:
        return "unknown", unknown
    return "pass", tuple(r.judgement.reason for r in results)


def run_gate(section: NcclSection, *, fault_file: str = "", timeout_s: float | None = None,
             nice: int = 0, stop: threading.Event | None = None, gpu_root: str = NVIDIA_GPUS,
             launch: Launch = run_once) -> GateResult:
    """Run every configured variant on this node and judge it."""
    started = time.monotonic()
    fp = fingerprint(section)
    try:
        p = plan(section, gpu_root)
    except PlanError as exc:
        return GateResult("unknown", (f"nccl test could not run: {exc}",), section.gpu_model, 0,
                          section.backend, 0.0, fp, finished_at=time.time())
    limit = section.timeout_s if timeout_s is None else min(section.timeout_s, timeout_s)
    results: list[VariantResult] = []
    for variant in section.variants:
        spec = spec_for(section, p, variant, timeout_s=limit, nice=nice, fault_file=fault_file)
        threshold = bandwidth.pick_threshold(section.thresholds, p.model, p.ranks, variant)
        result = run_variant(spec, threshold, variant, section.retries, stop, launch)
        results.append(result)
        if result.judgement.verdict in ("fail", "aborted"):
            break
    verdict, reasons = combine(results)
    out = GateResult(verdict, reasons, p.model, p.ranks, section.backend,
                     time.monotonic() - started, fp, tuple(results), time.time())
    log.info("nccl test done", verdict=verdict, reasons=list(reasons),
             seconds=round(out.seconds, 3))
    return out
