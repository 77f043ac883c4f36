"""Evidence that a GPU was repaired, which ends its fatal Xids before the window does.

A fatal Xid means "this GPU needs a reset (or worse)". Its drain must last until
that happened, not for a fixed time. The Xid check takes repair evidence from:

* a new boot (a new boot id: every GPU was reset);
* NVML seeing a GPU again that it had seen lost or missing (a GPU reset or rescan);
* this ledger: whoever proves a GPU healthy again (a clean active diagnostic, an
  operator after ``nvidia-smi -r``) calls :func:`record`, and the next gate run
  clears that GPU's fatal Xids logged before the repair that this kind of repair can
  end: a reset (``kind="reset"``) ends what needs a reset, a passing diagnostic
  (``kind="diag"``) only what NVIDIA says a diagnostic clears; neither ends what needs
  a new boot.

The ledger is an append-only file of JSON lines in the health state directory, so a
writer never needs the gate's lock (a diagnostic may run inside a gate run). Repairs
are idempotent: reading one twice changes nothing, so the file is only trimmed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

LEDGER = "xid-repairs.jsonl"
RESET = "reset"
DIAG = "diag"
KINDS = (RESET, DIAG)
# What a clean active diagnostic writes; ledger lines from before ``kind`` existed are
# told apart by it.
DIAG_EVIDENCE = "active diagnostic passed"
_MAX_BYTES = 256 << 10
_KEEP_BYTES = 64 << 10


@dataclass(frozen=True)
class Repair:
    """GPU ``pci`` (NVML ``00000000:9B:00.0`` or kernel ``0000:9b:00``) was repaired at
    ``time``; ``evidence`` says how (``dcgm diag level 3 passed``), ``kind`` what it was
    (:data:`RESET` or :data:`DIAG`)."""

    pci: str
    time: float
    evidence: str
    kind: str = ""  # empty: told from the evidence (see kind_of)


def kind_of(kind: object, evidence: str) -> str:
    """The repair kind of a saved entry; entries from before ``kind`` existed were a
    reset unless a diagnostic wrote them."""
    if kind in KINDS and kind:
        return str(kind)
    if kind not in (None, ""):
        raise ValueError(f"repair kind {kind!r} is none of {', '.join(KINDS)}")
    return DIAG if evidence.startswith(DIAG_EVIDENCE) else RESET


def pci_key(bus_id: str) -> str:
    """``00000000:9B:00.0`` (NVML) or ``0000:9b:00`` (kernel log) → ``0000:9b:00``."""
    text = bus_id.lower().split(".", 1)[0]
    parts = text.split(":")
    if len(parts) != 3:
        return text
    dom, bus, dev = parts
    try:
        return f"{int(dom, 16):04x}:{bus}:{dev}"
    except ValueError:
        return text


def record(state_dir: str, repair: Repair) -> None:
    """Append one repair to the ledger in ``state_dir`` (the health state directory)."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, LEDGER)
    line = json.dumps({"pci": pci_key(repair.pci), "time": repair.time,
                       "evidence": repair.evidence[:200],
                       "kind": kind_of(repair.kind, repair.evidence)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, line.encode())
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > _MAX_BYTES:
        _trim(path)


def _trim(path: str) -> None:
    kept = _tail(path, _KEEP_BYTES)
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.writelines(ln + "\n" for ln in kept)
    os.replace(tmp, path)


def _tail(path: str, max_bytes: int) -> list[str]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        data = os.pread(fd, max_bytes, start)
    finally:
        os.close(fd)
    lines = data.decode("utf-8", "replace").split("\n")
    if start and lines:
        lines = lines[1:]  # cut by the offset
    return [ln for ln in lines if ln.strip()]


def load(state_dir: str) -> tuple[list[Repair], int]:
    """Every repair in the ledger, and how many lines were garbled (the caller reports
    them; a lost repair can only delay a resume)."""
    if not state_dir:
        return [], 0
    try:
        lines = _tail(os.path.join(state_dir, LEDGER), _MAX_BYTES)
    except FileNotFoundError:
        return [], 0
    out: list[Repair] = []
    garbled = 0
    for ln in lines:
        try:
            item = json.loads(ln)
            evidence = str(item["evidence"])
            out.append(Repair(str(item["pci"]), float(item["time"]), evidence,
                              kind_of(item.get("kind"), evidence)))
        except (ValueError, KeyError, TypeError):
            garbled += 1
    return out, garbled
