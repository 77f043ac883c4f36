"""NVIDIA Xid codes: a short meaning for drain reasons, and which ones take a node out.

The meanings follow NVIDIA's Xid catalogue, shortened to fit a Slurm reason.

Fatal means "the node must not run another job until someone looks at it":
the GPU needs a reset or the hardware is failing. Xids that are usually the
application's own fault (13 graphics exception, 31 page fault, 43 stopped
processing, 45 preemptive cleanup, 109 context switch timeout) are reported
but never drain: draining on them would let one buggy job take nodes out.

Public tools disagree on three codes; our choices:

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

A site overrides the list with ``health.xid.fatal`` / ``extra_fatal`` /
``not_fatal``.
"""

from __future__ import annotations

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
}

# Xids after which the GPU needs a reset, or whose hardware is failing.
DEFAULT_FATAL: frozenset[int] = frozenset({
    48, 61, 62, 64, 74, 79, 95, 110, 119, 120, 121, 136, 140, 143,
    144, 146, 147, 148, 149, 150, 154,
})

# NVLink Xids (144-150) say themselves whether they are fatal: "SAW_MVB Nonfatal XC0 ...".
NVLINK_RANGE = range(144, 151)
_NONFATAL_WORD = re.compile(r"\bNonfatal\b")
# Xid 154 names the recovery action; "to 0x0 (None)" means nothing is needed any more.
_RECOVERY_NONE = re.compile(r"\bto 0x0 \(None\)")


def meaning(xid: int) -> str:
    return MEANINGS.get(xid, "unlisted Xid")


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
