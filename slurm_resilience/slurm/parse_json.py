"""Pure parsers for Slurm's JSON output: ``squeue --json`` and ``scontrol --json show
job|node`` (23.02+), data_parser v0.0.38 (22.05) to v0.0.45 (26.05).

The versions differ in shape, not in meaning, and each difference is handled where the
field is read: numbers became ``{"set", "infinite", "number"}`` objects (v0.0.39+), states
became lists (v0.0.40+; v0.0.39 had a lower-case state and ``state_flags``), node features
became lists, and 26.05 keeps the raw ``--output`` pattern in ``standard_output`` with the
expanded path in ``stdout_expanded``. 22.05 gives only the pattern, which is expanded here
the way Slurm expands a batch job's output name.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from slurm_resilience.slurm.parse import JobInfo, NodeInfo, expand_hostlist

# Slurm's NO_VAL for an array task id: the job is not part of an array.
_NO_ARRAY_TASK = 4294967294
_PATTERN = re.compile(r"%(\d*)(.)")


def _doc(text: str, key: str) -> list[Mapping[str, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Slurm's JSON output does not parse: {exc}: {text[:80]!r}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise ValueError(f"Slurm's JSON output has no {key!r} list: {text[:80]!r}")
    errors = doc.get("errors") or []
    if errors:
        raise ValueError(f"Slurm's JSON output reports errors: {errors}")
    return [r for r in doc[key] if isinstance(r, dict)]


def data_parser(text: str) -> str:
    """The data_parser (or 22.05's openapi plugin) version that wrote ``text``: "v0.0.42"."""
    meta = json.loads(text).get("meta", {})
    plugin = meta.get("plugin", {}) if isinstance(meta, dict) else {}
    name = str(plugin.get("data_parser") or plugin.get("type") or "")
    return name.rpartition("/")[2]


def _number(value: Any) -> int:
    """A plain number, or v0.0.39+'s {"set": true, "infinite": false, "number": N}."""
    if isinstance(value, dict):
        return int(value.get("number", 0) or 0) if value.get("set", True) else 0
    return int(value or 0)


def _text(value: Any) -> str:
    return "" if value in (None, "(null)", "None", "N/A", "n/a") else str(value)


def _list(value: Any) -> tuple[str, ...]:
    """A list, or the comma-separated string older versions print."""
    if isinstance(value, list):
        return tuple(str(v) for v in value if v)
    text = _text(value)
    return tuple(v for v in text.split(",") if v) if text else ()


def expand_output_pattern(pattern: str, job: Mapping[str, Any]) -> str:
    """Expand a batch job's ``--output`` pattern as Slurm does for its batch step.

    Raises ValueError on a specifier Slurm expands from data the JSON does not carry."""
    job_id = int(job["job_id"])
    task = _number(job.get("array_task_id"))
    array = task != _NO_ARRAY_TASK and "array_task_id" in job and task >= 0 \
        and _number(job.get("array_job_id")) > 0
    host = _text(job.get("batch_host")).split(".")[0]

    def one(m: re.Match[str]) -> str:
        width, spec = m.group(1), m.group(2)
        numbers = {"j": job_id, "J": job_id, "n": 0, "t": 0,
                   "A": _number(job.get("array_job_id")) if array else job_id,
                   "a": task if array else _NO_ARRAY_TASK, "b": task % 10 if array else 0}
        if spec in numbers:
            return str(numbers[spec]).zfill(int(width or 0))
        texts = {"%": "%", "x": _text(job.get("name")), "u": _text(job.get("user_name")),
                 "N": host, "s": "batch"}
        if spec in texts:
            return texts[spec]
        raise ValueError(f"job {job_id}: can't expand %{spec} in its output pattern {pattern!r}")

    return _PATTERN.sub(one, pattern)


def _std_out(job: Mapping[str, Any]) -> str:
    expanded = _text(job.get("stdout_expanded"))
    if expanded:  # 26.05+: standard_output is the raw pattern
        return expanded
    path = _text(job.get("standard_output"))
    return expand_output_pattern(path, job) if "%" in path else path


# The state flags the text form prints in place of the base state, first match wins
# (["PENDING", "COMPLETING"] reads JobState=COMPLETING there).
_SHOWN_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED",
                "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED",
                "RESV_DEL_HOLD", "SIGNALING")


def _state(value: Any) -> str:
    """v0.0.40+ lists the base state then its flags; read as the text form's JobState."""
    if isinstance(value, list):
        states = [str(v) for v in value]
        shown = [f for f in _SHOWN_FLAGS if f in states[1:]]
        return shown[0] if shown else states[0] if states else ""
    return _text(value)


def _exclusive(job: Mapping[str, Any]) -> bool | None:
    """v0.0.38 says "none" in ``shared`` for --exclusive and v0.0.42 lists it; 26.05's
    (the versions with ``stdout_expanded``) reports an exclusive job like any other, so
    there an empty ``shared`` says nothing: None."""
    shared = job.get("shared")
    flags = shared if isinstance(shared, list) else [shared] if shared else []
    if "none" in flags:
        return True
    return False if "oversubscribe" in flags or "stdout_expanded" not in job else None


def job_from_json(j: Mapping[str, Any]) -> JobInfo:
    """One job object of ``squeue --json`` or ``scontrol --json show job``."""
    return JobInfo(
        job_id=int(j["job_id"]),
        name=_text(j.get("name")),
        user=_text(j.get("user_name")),
        uid=_number(j.get("user_id", -1)),
        state=_state(j.get("job_state")),
        # What the text form prints as Reason: the description when Slurm set one
        # ("job_requeued_in_held_state"), else the reason code ("JobHeldUser").
        reason=_text(j.get("state_description")).replace(" ", "_")
        or _text(j.get("state_reason")),
        nodes=tuple(expand_hostlist(_text(j.get("nodes")))),
        batch_host=_text(j.get("batch_host")),
        restarts=_number(j.get("restart_cnt")),
        requeue=bool(j.get("requeue", False)),
        comment=_text(j.get("comment")),
        admin_comment=_text(j.get("admin_comment")),
        partition=_text(j.get("partition")),
        exc_nodes=tuple(expand_hostlist(_text(j.get("excluded_nodes")))),
        req_nodes=tuple(expand_hostlist(_text(j.get("required_nodes")))),
        work_dir=_text(j.get("current_working_directory")),
        std_out=_std_out(j),
        num_nodes=_number(j.get("node_count")),
        priority=_number(j.get("priority")),
        features=_text(j.get("features")),
        switches=_number(j.get("required_switches")),
        switch_wait_s=_number(j.get("maximum_switch_wait_time")),
        exclusive=_exclusive(j),
        submit_time=_number(j.get("submit_time")),
        start_time=_number(j.get("start_time")),
        raw=j,
    )


def parse_jobs_json(text: str) -> list[JobInfo]:
    """Every job in ``squeue --json`` or ``scontrol --json show job`` output."""
    return [job_from_json(j) for j in _doc(text, "jobs")]


def node_from_json(n: Mapping[str, Any]) -> NodeInfo:
    """One node object of ``scontrol --json show node`` (or ``sinfo --json``'s nodes)."""
    state = n.get("state")
    if isinstance(state, list):  # v0.0.40+: ["IDLE", "DRAIN"]
        parts = [str(s).upper() for s in state]
    else:  # v0.0.39: "idle" plus "state_flags": ["DRAIN"]
        parts = [_text(state).upper(), *(str(s).upper() for s in n.get("state_flags", []))]
    changed = _number(n.get("reason_changed_at"))
    return NodeInfo(
        name=str(n["name"]),
        state=parts[0] if parts else "",
        flags=frozenset(p for p in parts[1:] if p),
        reason=_text(n.get("reason")),
        reason_user=_text(n.get("reason_set_by_user")),
        # The text form's local "YYYY-MM-DDTHH:MM:SS", so both read the same.
        reason_time=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(changed))
        if changed else "",
        features=_list(n.get("features")),
        active_features=_list(n.get("active_features")),
        gres=_text(n.get("gres")),
        partitions=_list(n.get("partitions")),
        cpus=_number(n.get("cpus")),
        alloc_cpus=_number(n.get("alloc_cpus")),
        address=_text(n.get("address")),
        hostname=_text(n.get("hostname")),
        port=_number(n.get("port")),
        comment=_text(n.get("comment")),
        raw=n,
    )


def parse_nodes_json(text: str) -> list[NodeInfo]:
    """Every node in ``scontrol --json show node`` output."""
    return [node_from_json(n) for n in _doc(text, "nodes")]


# The name the adapter and tests used before scontrol's JSON was read too.
parse_squeue_json = parse_jobs_json
