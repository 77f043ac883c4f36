"""The NVML fabric answers (``nvmlDeviceGetGpuFabricInfoV``) that real captures show.

Three kinds of public capture name a GPU's NVLink fabric: the ``Fabric`` block of
``nvidia-smi -q``, NCCL's ``NCCL INFO MNNVL ... fabric UUID ... healthMask`` line, and a
monitoring agent's JSON of the same fields. Each is turned into the stand-in's scenario
``fabric`` entry (state, status, health_mask, health_summary, cluster_uuid, clique_id), so
a fake GPU answers what the captured GPU answered. The mapping is nvml.h's: the health mask
is four 2-bit fields (0 not supported, 1 TRUE = the fault, 2 FALSE) and a 4-bit incorrect
configuration field (1 = none); ``N/A`` / ``Not Supported`` is 0.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from slurm_resilience.fakes import nvml_constants as C

STATES = {"not supported": C.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, "n/a": 0,
          "not started": C.NVML_GPU_FABRIC_STATE_NOT_STARTED,
          "in progress": C.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
          "completed": C.NVML_GPU_FABRIC_STATE_COMPLETED}
# nvidia-smi's text for an nvmlReturn_t (nvmlErrorString), as the Status row prints it.
STATUSES = {"success": C.NVML_SUCCESS, "n/a": C.NVML_SUCCESS, "not supported": 3,
            "insufficient resources": 23, "unknown error": 999}
SUMMARIES = {"n/a": 0, "not supported": 0, "healthy": 1, "unhealthy": 2, "limited capacity": 3}
# (nvidia-smi row, JSON key, shift, {text: field value}) of the mask's 2-bit fields.
MASK_ROWS = (
    ("bandwidth", "bandwidth", C.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
     {"degraded": 1, "full": 2}),
    ("route recovery in progress", "route_recovery_in_progress",
     C.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY, {"true": 1, "false": 2}),
    ("route unhealthy", "route_unhealthy", C.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY,
     {"true": 1, "false": 2}),
    ("access timeout recovery", "access_timeout_recovery",
     C.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY, {"true": 1, "false": 2}),
)
INCORRECT_CONFIG = {"none": 1, "incorrect sysguid": 2, "incorrect chassis serial number": 3,
                    "no partition": 4, "insufficient nvlinks": 5,
                    "incompatible gpu firmware": 6, "invalid location": 7,
                    "gpu state invalid": 8}
_ROW = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")
_NCCL = re.compile(r"NCCL INFO MNNVL busId (0x[0-9a-f]+) fabric UUID ([0-9a-f]+)\.([0-9a-f]+) "
                   r"cliqueId (0x[0-9a-f]+) state (\d+) healthMask (0x[0-9a-f]+)")


class CaptureError(ValueError):
    """A capture this module cannot read; the message names the line or field."""


def _lookup(table: dict[str, int], text: str, what: str) -> int:
    key = text.strip().lower()
    if key not in table:
        raise CaptureError(f"unknown {what} {text!r} (known: {', '.join(sorted(table))})")
    return table[key]


def entry(fields: dict[str, str], health: dict[str, str]) -> dict[str, Any]:
    """The scenario entry from a Fabric block's rows (``fields``) and its Health rows, keys
    in lower case as nvidia-smi names them."""
    mask = 0
    for row, _key, shift, values in MASK_ROWS:
        text = health.get(row, "n/a").lower()
        if text not in ("n/a", "not supported"):
            mask |= _lookup(values, text, row) << shift
    config = health.get("incorrect configuration", "n/a").lower()
    if config not in ("n/a", "not supported"):
        mask |= _lookup(INCORRECT_CONFIG, config, "incorrect configuration") \
            << C.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION
    clique = fields.get("cliqueid", "n/a")
    cluster = fields.get("clusteruuid", "n/a")
    return {"state": _lookup(STATES, fields.get("state", "n/a"), "fabric state"),
            "status": _lookup(STATUSES, fields.get("status", "n/a"), "fabric status"),
            "health_mask": mask,
            "health_summary": _lookup(SUMMARIES, health.get("summary", "n/a"), "summary"),
            "clique_id": None if clique.lower() == "n/a" else int(clique),
            "cluster_uuid": None if cluster.lower() == "n/a" else str(uuid.UUID(cluster))}


def from_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Each ``Fabric`` block of an ``nvidia-smi -q`` text (a whole capture or an excerpt),
    in order, as the scenario's fabric entry."""
    out: list[dict[str, Any]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "Fabric":
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        fields: dict[str, str] = {}
        health: dict[str, str] = {}
        i += 1
        in_health = False
        while i < len(lines):
            line = lines[i]
            if not line.strip() or len(line) - len(line.lstrip()) <= indent:
                break
            if line.strip() == "Health":
                in_health = True
            else:
                m = _ROW.match(line)
                if not m:
                    raise CaptureError(f"fabric block: unreadable line {line!r}")
                key, value = m.group(2).strip().lower(), m.group(3)
                (health if in_health else fields)[key] = value
            i += 1
        out.append(entry(fields, health))
    return out


def from_nccl_log(text: str) -> list[dict[str, Any]]:
    """NCCL's ``MNNVL busId ... healthMask`` lines, one entry per GPU (by bus id, sorted).

    NCCL prints the cluster UUID as its two 64-bit words (``%lx.%lx``) from a little-endian
    host: each word's bytes reversed.
    """
    by_bus: dict[int, dict[str, Any]] = {}
    for m in _NCCL.finditer(text):
        raw = int(m.group(2), 16).to_bytes(8, "little") + int(m.group(3), 16).to_bytes(8, "little")
        by_bus[int(m.group(1), 16)] = {
            "state": int(m.group(5)), "status": C.NVML_SUCCESS,
            "health_mask": int(m.group(6), 16),
            # NCCL does not print the summary; a mask with every field FALSE is healthy.
            "health_summary": C.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY,
            "clique_id": int(m.group(4), 16), "cluster_uuid": str(uuid.UUID(bytes=raw))}
    if not by_bus:
        raise CaptureError("no `NCCL INFO MNNVL busId ... healthMask` line")
    return [by_bus[bus] for bus in sorted(by_bus)]


def from_gpud_json(text: str) -> list[dict[str, Any]]:
    """A gpud ``fabric_states`` list: one entry per GPU, in order."""
    try:
        states = json.loads(text)["fabric_states"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CaptureError(f"not a gpud fabric_states JSON: {exc}") from None
    out = []
    for s in states:
        health = {row: str(s["health"].get(key, "n/a")) for row, key, _, _ in MASK_ROWS}
        health["summary"] = str(s.get("summary", "n/a"))
        out.append(entry({"state": str(s["state"]), "status": str(s["status"]),
                           "cliqueid": str(s["clique_id"]),
                           "clusteruuid": str(s["cluster_uuid"])}, health))
    return out
