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

Each entry's :data:`SOURCES` names the public NVIDIA document (title, section, URL) its
meaning comes from, and then the basis of its fatal / not-fatal decision: NVIDIA's
immediate action where we read it in the Xid Catalog (:data:`ACTIONS`), the driver's own
word in the message (NVLink 144-150, recovery action 154), our reading of the meaning
(the GPU needs a reset, or the application is at fault), or a choice of this project
marked "(ours)" and explained above. A site overrides the list with ``health.xid.fatal`` /
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


# NVLink Xids (144-150) say themselves whether they are fatal: "SAW_MVB Nonfatal XC0 ...".
NVLINK_RANGE = range(144, 151)


class Action(enum.Enum):
    """NVIDIA's immediate action for an Xid (the catalogue's resolution bucket)."""

    RESET_GPU = "RESET_GPU"
    RESTART_APP = "RESTART_APP"
    IGNORE = "IGNORE"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    UNKNOWN = "UNKNOWN"


# The public documents the entries rest on. NVIDIA revises them in place: re-read them
# when a new driver branch adds Xids.
XID_DOC = ("NVIDIA 'Xid Errors', the Xid's entry "
           "(https://docs.nvidia.com/deploy/xid-errors/index.html)")
XID_CATALOG = ("NVIDIA 'Analyzing Xid Errors with the Xid Catalog', column 'Resolution Bucket "
               "(Immediate Action)' "
               "(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html)")
PAGE_RETIREMENT = ("NVIDIA 'Dynamic Page Retirement', section 'Visibility: XIDs' "
                   "(https://docs.nvidia.com/deploy/dynamic-page-retirement/visibility.html)")
MEMORY_ERRORS = ("NVIDIA 'GPU Memory Error Management' (row remapping, contained and "
                 "uncontained errors) (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/)")
RECOVERY_ACTION = ("NVML 'nvmlDeviceGpuRecoveryAction_t' (driver R570+), which Xid 154 "
                   "reports (https://docs.nvidia.com/deploy/nvml-api/)")

# NVIDIA's immediate action, only where we read it in the catalogue itself.
ACTIONS: dict[int, Action] = {
    8: Action.RESTART_APP, 13: Action.RESTART_APP,
    46: Action.RESET_GPU, 121: Action.IGNORE,
    155: Action.RESET_GPU, 156: Action.RESET_GPU, 158: Action.RESET_GPU,
}

_RESET = "fatal: the GPU needs a reset or its hardware is failing (our reading of the meaning)"
_APP = "not fatal: usually the application's own fault; one buggy job must not drain nodes"

# Where each entry's meaning, and its fatal / not-fatal decision, come from. Every value
# reads "<document> -- fatal: <basis>" or "<document> -- not fatal: <basis>";
# test_health_xid checks that the word matches DEFAULT_FATAL.
SOURCES: dict[int, str] = {
    **{x: f"{XID_DOC} -- {_RESET}" for x in (61, 62, 74, 79, 110, 119, 120, 136, 143)},
    **{x: f"{XID_DOC} -- not fatal (ours): reported, not drained; the meaning names no "
          "hardware fault or reset, and a repeat shows in the Xid rate" for x in (32, 38, 44,
                                                                               69, 123)},
    48: f"{PAGE_RETIREMENT}; {MEMORY_ERRORS} -- {_RESET} (double-bit error)",
    64: f"{PAGE_RETIREMENT}; {MEMORY_ERRORS} -- {_RESET} (the retirement/remap failed)",
    95: f"{MEMORY_ERRORS} -- {_RESET} (uncontained: the error may have spread)",
    140: f"{MEMORY_ERRORS} -- {_RESET} (unrecovered ECC error)",
    **{x: f"{XID_DOC} -- {_APP}" for x in (31, 43, 45, 109)},
    94: f"{MEMORY_ERRORS} -- not fatal: contained to the application that hit it; the "
        "remap it needs is judged through NVML's remap-pending state",
    **{x: f"{XID_CATALOG}: RESTART_APP -- {_APP}" for x in (8, 13)},
    **{x: f"{XID_CATALOG}: RESET_GPU -- fatal: NVIDIA's immediate action is a GPU reset"
       for x in (46, 155, 156, 158)},
    121: f"{XID_CATALOG}: IGNORE -- not fatal: the C2C link recovers by itself",
    **{x: f"{XID_DOC} -- fatal, unless the driver's own message says 'Nonfatal' "
          "(is_fatal reads it)" for x in NVLINK_RANGE},
    154: f"{RECOVERY_ACTION} -- fatal, unless the message names the action 'None'",
    63: f"{PAGE_RETIREMENT} -- not fatal (ours): NVML's remap-pending state is checked "
        "instead, and clears on the reset (see above)",
    68: f"{XID_DOC} -- not fatal (ours): NVDEC is not used by training (see above)",
    92: f"{XID_DOC} -- not fatal (ours): the errors were corrected; the ECC counters are "
        "checked instead (see above)",
}

# Xids after which the GPU needs a reset, or whose hardware is failing.
DEFAULT_FATAL: frozenset[int] = frozenset({
    46, 48, 61, 62, 64, 74, 79, 95, 110, 119, 120, 136, 140, 143,
    144, 145, 146, 147, 148, 149, 150, 154, 155, 156, 158,
})

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
