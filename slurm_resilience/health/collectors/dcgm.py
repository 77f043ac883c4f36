"""DCGM active diagnostics: ``dcgmi diag -r LEVEL -j`` and its JSON.

Two schemas exist. DCGM 3.x writes ``{"DCGM GPU Diagnostic": {"test_categories":
[{"category", "tests": [{"name", "results": [{"gpu_ids" | "gpu_id", "status",
"warnings"}]}]}], "version"}}``; DCGM 4.x renamed the top key to ``DCGM Diagnostic``,
names the entity of each result (``entity_group``, ``entity_group_id``, ``entity_id``),
adds a per-test ``test_summary`` and moves the versions under ``metadata``. Warnings
are plain strings in old releases and ``{"warning", "error_id", ...}`` objects later.
Both are read here into one typed record. Real captures (``tests/fixtures/dcgm``,
sources in ``SOURCES.md``) also show: software tests of 3.x with no GPU key at all, a
document with no ``version``, and ``info`` as a string (3.x) or a list (4.x), which is
not read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.proc import CommandError, Runner

STATUSES = ("pass", "fail", "warn", "skip")


@dataclass
class DiagResult:
    category: str
    test: str
    gpu: int | None  # None: a result for all GPUs (software/deployment tests)
    status: str  # pass, fail, warn, skip (lower case)
    warnings: list[str] = field(default_factory=list)
    error_ids: list[int] = field(default_factory=list)
    # DCGM 4's dcgmErrorSeverity_t per error id (absent from 3.x documents)
    error_severities: dict[int, int] = field(default_factory=dict)


@dataclass
class DiagReport:
    version: str = ""
    driver: str = ""
    results: list[DiagResult] = field(default_factory=list)
    error: str | None = None  # dcgmi could not run, or printed no diagnostic


class DcgmParseError(ValueError):
    """Text that is not a dcgmi diag JSON document."""


def _gpu(result: dict[str, Any]) -> int | None:
    if "entity_id" in result:
        group = str(result.get("entity_group", "GPU")).upper()
        return int(result["entity_id"]) if group == "GPU" else None
    ids = str(result.get("gpu_id", result.get("gpu_ids", "")))
    return int(ids) if ids.isdigit() else None


def _warnings(result: dict[str, Any]) -> tuple[list[str], list[int], dict[int, int]]:
    texts: list[str] = []
    codes: list[int] = []
    severities: dict[int, int] = {}
    for w in result.get("warnings", []) or []:
        if isinstance(w, dict):
            texts.append(str(w.get("warning", "")).strip())
            if isinstance(w.get("error_id"), int):
                codes.append(int(w["error_id"]))
                if isinstance(w.get("error_severity"), int):
                    severities[int(w["error_id"])] = int(w["error_severity"])
        else:
            texts.append(str(w).strip())
    return texts, codes, severities


def parse_diag(text: str) -> DiagReport:
    """The JSON document in ``text`` (dcgmi may print a line before it)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise DcgmParseError("no JSON object in dcgmi output")
    try:
        doc = json.loads(text[start:end + 1])
    except ValueError as exc:
        raise DcgmParseError(f"dcgmi output is not JSON: {exc}") from None
    body = doc.get("DCGM Diagnostic") or doc.get("DCGM GPU Diagnostic")
    if not isinstance(body, dict):
        raise DcgmParseError("no 'DCGM Diagnostic' / 'DCGM GPU Diagnostic' object")
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else body
    report = DiagReport(version=str(meta.get("version", "")),
                        driver=str(meta.get("Driver Version Detected",
                                            body.get("Driver Version Detected", ""))))
    if body.get("runtime_error"):
        report.error = f"dcgmi: {body['runtime_error']}"
    for cat in body.get("test_categories", []) or []:
        for test in cat.get("tests", []) or []:
            results = [r for r in test.get("results", []) or []
                       if isinstance(r, dict) and "status" in r]
            summary = test.get("test_summary")
            if not results and isinstance(summary, dict) and "status" in summary:
                # 4.x: a test may carry only its summary; it is then the node's result.
                results = [{k: v for k, v in summary.items() if k != "info"}]
            for res in results:
                status = str(res["status"]).strip().lower()
                texts, codes, severities = _warnings(res)
                report.results.append(DiagResult(
                    str(cat.get("category", "")), str(test.get("name", "")), _gpu(res),
                    status if status in STATUSES else status or "unknown", texts, codes,
                    severities))
    return report


def collect(level: int, timeout: float, runner: Runner | None = None) -> DiagReport:
    """Run ``dcgmi diag``; a failing test makes dcgmi exit non-zero with its JSON intact."""
    if shutil.which("dcgmi") is None:
        return DiagReport(error="dcgmi not installed")
    try:
        done = (runner or Runner()).run(["dcgmi", "diag", "-r", str(level), "-j"],
                                        timeout=timeout, check=False)
    except CommandError as exc:
        return DiagReport(error=f"dcgmi diag: {str(exc).splitlines()[0]}")
    try:
        return parse_diag(done.stdout)
    except DcgmParseError as exc:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return DiagReport(error=f"dcgmi diag exited {done.returncode}: {exc} ({tail[0][:200]})")


def to_json(report: DiagReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


def from_json(d: dict[str, Any]) -> DiagReport:
    return DiagReport(str(d.get("version", "")), str(d.get("driver", "")),
                      [DiagResult(**{**r, "error_severities": {
                          int(k): int(v) for k, v in r.get("error_severities", {}).items()}})
                       for r in d.get("results", [])], d.get("error"))
