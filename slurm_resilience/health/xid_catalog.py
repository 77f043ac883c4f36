"""NVIDIA Xid codes: a short meaning for drain reasons, and which ones take a node out.

The meanings follow NVIDIA's Xid catalogue, shortened to fit a Slurm reason.

Fatal means "the node must not run another job until someone looks at it":
the GPU needs a reset or the hardware is failing. Xids that are usually the
application's own fault (13 graphics exception, 31 page fault, 43 stopped
processing, 45 preemptive cleanup, 109 context switch timeout) are reported
but never drain: draining on them would let one buggy job take nodes out.

Public tools disagree on four codes; our choices:

* **63** (row remapping / page retirement *recorded*): not fatal. The remap is
  pending until the next GPU reset, and NVML reports exactly that
  (``remapped rows pending``), which the GPU check fails on. The NVML state
  clears after the reset; an Xid-based drain would outlive the repair for
  the whole window.
* **68** (video decoder exception): not fatal. It concerns NVDEC, which
  training does not use, and is usually triggered by the decoding application.
* **92** (high single-bit ECC error rate): not fatal. The errors were
  corrected; the ECC counters and row remapping (checked through NVML) are
  what says whether memory is failing.
* **121** (C2C link error, GB200): not fatal. NVIDIA's immediate action is IGNORE
  (the link recovers by itself); draining on it would take GB200 nodes out for nothing.

Each entry's :data:`SOURCES` names where its action comes from: "catalog" is the
"Resolution Bucket (Immediate Action)" column of NVIDIA's Xid Catalog for Ampere and
newer GPUs (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html);
"R570" is the driver's own "GPU recovery action" that Xid 154 reports
(NVML ``nvmlDeviceGpuRecoveryAction_t``); "documentation" is the meaning in NVIDIA's
Xid documentation with our fatal choice; ``ours`` is a choice of this project,
explained above. A site overrides the list with ``health.xid.fatal`` /
``extra_fatal`` / ``not_fatal``.
"""

from __future__ import annotations

import enum
import re

MEANINGS: dict[int, str] = {
    8: "GPU stopped processing (timeout)",
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer",
    38: "driver firmware error",
    43: "GPU stopped processing",
    44: "graphics engine fault during context switch",
    45: "preemptive cleanup after previous errors",
    46: "GPU stopped processing",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "row remap/page retirement recorded",
    64: "row remap/page retirement failed",
    68: "video decoder exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    110: "security fault",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    123: "SPI PMU RPC write failure",
    136: "link training failed",
    140: "unrecovered ECC error",
    143: "GPU initialization failure",
    144: "NVLink SAW error",
    145: "NVLink RLW error",
    146: "NVLink TLW error",
    147: "NVLink TREX error",
    148: "NVLink NVLPW control error",
    149: "NVLink NETIR error",
    150: "NVLink MSE error",
    154: "GPU recovery action changed",
    155: "fault that needs a GPU reset",
    156: "fault that needs a GPU reset",
    158: "fault that needs a GPU reset",
}


class Action(enum.Enum):
    """NVIDIA's immediate action for an Xid (the catalogue's resolution bucket)."""

    RESET_GPU = "RESET_GPU"
    RESTART_APP = "RESTART_APP"
    IGNORE = "IGNORE"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    UNKNOWN = "UNKNOWN"


_CATALOG = "NVIDIA Xid Catalog, immediate action"
_DOC = "NVIDIA Xid documentation (meaning); fatal by our choice: the GPU needs a reset"
_APP = "NVIDIA Xid documentation: usually the application's fault; never drains"

# NVIDIA's immediate action, only where we read it in the catalogue itself.
ACTIONS: dict[int, Action] = {
    8: Action.RESTART_APP, 13: Action.RESTART_APP,
    46: Action.RESET_GPU, 121: Action.IGNORE,
    155: Action.RESET_GPU, 156: Action.RESET_GPU, 158: Action.RESET_GPU,
}

# Where each entry's meaning and fatal/not-fatal choice comes from.
SOURCES: dict[int, str] = {
    **{x: _DOC for x in (32, 38, 44, 48, 61, 62, 64, 69, 74, 79, 95, 110, 119, 120, 123,
                         136, 140, 143)},
    **{x: _APP for x in (31, 43, 45, 94, 109)},
    **{x: f"{_CATALOG} RESTART_APP" for x in (8, 13)},
    **{x: f"{_CATALOG} RESET_GPU" for x in (46, 155, 156, 158)},
    121: f"{_CATALOG} IGNORE (C2C link recovers by itself)",
    **{x: "NVIDIA Xid documentation; the message says Fatal or Nonfatal, which decides"
       for x in range(144, 151)},
    154: "driver R570+ recovery action (NVML nvmlDeviceGpuRecoveryAction_t) in the message",
    63: "ours: NVML's remap-pending state is checked instead (see above)",
    68: "ours: NVDEC is not used by training (see above)",
    92: "ours: corrected errors; the ECC counters are checked instead (see above)",
}

# Xids after which the GPU needs a reset, or whose hardware is failing.
DEFAULT_FATAL: frozenset[int] = frozenset({
    46, 48, 61, 62, 64, 74, 79, 95, 110, 119, 120, 136, 140, 143,
    144, 145, 146, 147, 148, 149, 150, 154, 155, 156, 158,
})

# NVLink Xids (144-150) say themselves whether they are fatal: "SAW_MVB Nonfatal XC0 ...".
NVLINK_RANGE = range(144, 151)
_NONFATAL_WORD = re.compile(r"\bNonfatal\b")
# Xid 154 names the recovery action; "to 0x0 (None)" means nothing is needed any more.
_RECOVERY_NONE = re.compile(r"\bto 0x0 \(None\)")


def meaning(xid: int) -> str:
    return MEANINGS.get(xid, "unlisted Xid")


def action(xid: int) -> Action:
    return ACTIONS.get(xid, Action.UNKNOWN)


def fatal_set(fatal: tuple[int, ...] = (), extra: tuple[int, ...] = (),
              not_fatal: tuple[int, ...] = ()) -> frozenset[int]:
    """The effective fatal list from the site's settings."""
    base = frozenset(fatal) if fatal else DEFAULT_FATAL
    return (base | frozenset(extra)) - frozenset(not_fatal)


def is_fatal(xid: int, text: str, fatal: frozenset[int]) -> bool:
    """Whether one event is fatal, using what the driver's message itself says where it can."""
    if xid not in fatal:
        return False
    if xid in NVLINK_RANGE and _NONFATAL_WORD.search(text):
        return False
    return not (xid == 154 and _RECOVERY_NONE.search(text))
