"""NVIDIA Xid codes: a short meaning for drain reasons, NVIDIA's immediate action, and
what ends the drain.

Every entry follows the "Resolution Bucket (Immediate Action)" of NVIDIA's Xid Catalog
(:data:`XID_CATALOG`) for Ampere and newer GPUs:

* ``RESTART_BM`` (restart the bare-metal node), ``CHECK_MECHANICALS`` (re-seat: the node
  is powered off) and ``RESTART_VM`` drain until a **new boot**;
* ``RESET_GPU`` (and ``WORKFLOW_XID_48``) drain until a **GPU reset or a new boot**;
* ``RESTART_APP`` and ``IGNORE`` never drain. Where NVIDIA's investigatory action says
  that *repeats on one GPU* need a diagnostic (Xid 13, 31: DCGM EUD), repeats are
  reported and ask for one (:attr:`Entry.diag_on_repeat`); a passing diagnostic ends
  that request, and nothing else;
* 74, 144-150 and 154 are decoded from their message (:mod:`xid_decode`).

A passing diagnostic is never a reset: it ends no reset- or reboot-requiring Xid. Xid
154 and NVML's recovery action can only make a GPU's ending stricter (the check does
that). Where we differ from NVIDIA's action, :attr:`Entry.differs` says so and why. A
site overrides the drain list with ``health.xid.fatal`` / ``extra_fatal`` /
``not_fatal``; a code added there ends with a reset or a new boot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slurm_resilience.health import xid_decode


class Action(enum.Enum):
    """NVIDIA's immediate action for an Xid (the catalogue's resolution bucket)."""

    RESTART_BM = "RESTART_BM"
    RESET_GPU = "RESET_GPU"
    RESTART_APP = "RESTART_APP"
    IGNORE = "IGNORE"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"
    RESTART_VM = "RESTART_VM"
    CHECK_UVM = "CHECK_UVM"
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"
    XID_154 = "XID_154"
    NONE_GIVEN = "NONE_GIVEN"  # the catalogue row has no action (162-172 at the time read)
    UNKNOWN = "UNKNOWN"


class Ending(enum.IntEnum):
    """What ends a drain, weakest first: a stricter ending is never met by a weaker one."""

    NONE = 0  # not fatal
    DIAG = 1  # a passing diagnostic, a GPU reset or a new boot
    RESET = 2  # a GPU reset or a new boot
    BOOT = 3  # only a new boot

    @property
    def need(self) -> str:
        """The words a drain reason ends with."""
        return {Ending.NONE: "", Ending.DIAG: "diagnostic required",
                Ending.RESET: "reset required", Ending.BOOT: "reboot required"}[self]


XID_DOC = ("NVIDIA 'Xid Errors', the Xid's entry "
           "(https://docs.nvidia.com/deploy/xid-errors/index.html)")
XID_CATALOG = ("NVIDIA 'Analyzing Xid Errors with the Xid Catalog', column 'Resolution Bucket "
               f"(Immediate Action)' ({xid_decode.CATALOG_URL})")
MEMORY_ERRORS = ("NVIDIA 'GPU Memory Error Management' (row remapping, contained and "
                 "uncontained errors) (https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/)")
RECOVERY_ACTION = ("NVML 'nvmlDeviceGpuRecoveryAction_t' (driver R570+), which Xid 154 "
                   "reports (https://docs.nvidia.com/deploy/nvml-api/)")


@dataclass(frozen=True)
class Entry:
    meaning: str
    action: Action
    ending: Ending  # what we do: NONE never drains
    differs: str = ""  # where our ending is not NVIDIA's action, and why
    diag_on_repeat: str = ""  # NVIDIA's diagnostic for repeats on one GPU
    source: str = XID_CATALOG


_A, _E = Action, Ending


def _app(meaning: str, **kw: str) -> Entry:
    return Entry(meaning, _A.RESTART_APP, _E.NONE, **kw)


def _ignore(meaning: str, **kw: str) -> Entry:
    return Entry(meaning, _A.IGNORE, _E.NONE, **kw)


def _reset(meaning: str, **kw: str) -> Entry:
    return Entry(meaning, _A.RESET_GPU, _E.RESET, **kw)


_EUD = "DCGM EUD (possible hardware issue), then field diagnostics if it passes"

ENTRIES: dict[int, Entry] = {
    8: _app("GPU stopped processing (timeout)"),
    11: _app("invalid or corrupted push buffer"),
    13: _app("graphics engine exception", diag_on_repeat=_EUD),
    14: _ignore("injected error"),
    25: _app("invalid or illegal push buffer"),
    31: _app("GPU memory page fault", diag_on_repeat=_EUD),
    32: _app("invalid or corrupted push buffer"),
    **{x: _app("copy engine exception") for x in (39, 40, 41)},
    37: _ignore("driver firmware error"),
    38: _ignore("driver firmware error"),
    43: _ignore("GPU stopped processing"),
    44: _ignore("graphics engine fault during context switch"),
    45: Entry("preemptive cleanup after previous errors", _A.WORKFLOW_XID_45, _E.NONE,
              differs="NVIDIA: alone, restart Fabric Manager; with other Xids, follow "
                      "those. Reported, not drained: a job Slurm kills (scancel, time "
                      "limit) logs a lone Xid 45 as well"),
    46: _reset("GPU stopped processing"),
    48: Entry("double-bit ECC error", _A.WORKFLOW_XID_48, _E.RESET,
              source=f"{XID_CATALOG}; {MEMORY_ERRORS}"),
    54: Entry("auxiliary power not connected", _A.CHECK_MECHANICALS, _E.BOOT,
              differs="ends with a new boot: re-seating a power cable means powering the "
                      "node off"),
    60: _app("video processor exception"),
    61: Entry("internal micro-controller breakpoint", _A.CONTACT_SUPPORT, _E.RESET,
              differs="unused on Ampere and newer (CONTACT_SUPPORT); on older GPUs our "
                      "reading: the micro-controller needs a reset",
              source=XID_DOC),
    62: _reset("internal micro-controller halt"),
    63: Entry("row remap recorded", _A.IGNORE, _E.NONE,
              source=f"{XID_CATALOG}; {MEMORY_ERRORS}",
              differs="the pending remap is judged by the gpu check (NVML remap pending), "
                      "which clears on the reset"),
    64: _reset("row remap/page retirement failed", source=f"{XID_CATALOG}; {MEMORY_ERRORS}"),
    66: _ignore("illegal access by driver"),
    67: _ignore("illegal access by driver"),
    68: _app("video decoder exception"),
    69: _app("graphics engine class error"),
    **{x: _app("copy engine error") for x in (70, 71, 72, 75, 76, 77, 85)},
    74: Entry("NVLink error", _A.WORKFLOW_NVLINK_ERR, _E.RESET),
    79: Entry("GPU fell off the bus", _A.RESTART_BM, _E.BOOT),
    80: _app("corrupted data sent to GPU"),
    **{x: _app("video/JPEG engine error")
       for x in (82, 83, 84, 86, 88, 89, *range(96, 106), 139)},
    92: _ignore("high single-bit ECC error rate",
                differs="none; the corrected-ECC rate is judged by the gpu check"),
    93: _ignore("InfoROM wear limit reached"),
    94: Entry("contained ECC error", _A.RESTART_APP, _E.NONE,
              source=f"{XID_CATALOG}; {MEMORY_ERRORS}"),
    95: _reset("uncontained ECC error", source=f"{XID_CATALOG}; {MEMORY_ERRORS}"),
    106: _ignore("SMBPBI test message"),
    107: _ignore("SMBPBI test message"),
    108: _ignore("NVLink remote translation error"),
    109: _reset("context switch timeout"),
    110: Entry("security fault", _A.RESET_GPU, _E.BOOT,
               differs="stricter: NVIDIA's trigger text asks for a cold reset of the system, "
                       "so only a new boot ends it"),
    119: _reset("GSP RPC timeout"),
    120: _reset("GSP error"),
    121: _ignore("C2C link error"),
    123: Entry("SPI PMU RPC write failure", _A.CONTACT_SUPPORT, _E.NONE,
               differs="unused on Ampere and newer: reported, not drained", source=XID_DOC),
    **{x: _app("copy engine error") for x in range(126, 136)},
    136: _reset("link training failed"),
    137: _ignore("NVLink privilege error"),
    140: _reset("unrecovered ECC error"),
    141: _ignore("CUDA fast path error"),
    142: Entry("NVENC3 error", _A.CONTACT_SUPPORT, _E.NONE,
               differs="reported, not drained: a video encoder, which training does not use "
                       "(as NVIDIA's RESTART_APP for the decoders, 68 and 83-98)"),
    143: _reset("GPU initialization failure"),
    144: Entry("NVLink SAW error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    145: Entry("NVLink RLW error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    146: Entry("NVLink TLW error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    147: Entry("NVLink TREX error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    148: Entry("NVLink NVLPW control error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    149: Entry("NVLink NETIR error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    150: Entry("NVLink MSE error", _A.WORKFLOW_NVLINK5_ERR, _E.RESET),
    151: Entry("key rotation error", _A.RESTART_VM, _E.BOOT,
               differs="restarting the VM that owns the GPU is a new boot of the node "
                       "where the gate runs inside that VM"),
    152: _ignore("DLA SMMU error"),
    153: _ignore("DLA timeout"),
    154: Entry("GPU recovery action changed", _A.XID_154, _E.RESET, source=RECOVERY_ACTION),
    155: _reset("NVLink link down (software defined)"),
    156: _reset("resource retirement event"),
    157: _ignore("resource retirement failure"),
    158: _reset("GPU fatal timeout"),
    159: Entry("C2C CHI non-data error", _A.CHECK_UVM, _E.RESET,
               differs="CHECK_UVM is RESET_GPU when UVM is in use, else IGNORE; every CUDA "
                       "training process loads nvidia-uvm, so it drains"),
    160: _ignore("channel retirement event"),
    161: _ignore("channel retirement failure"),
    162: Entry("power smoothing re-engaged", _A.NONE_GIVEN, _E.NONE),
    163: Entry("power smoothing disengaged", _A.NONE_GIVEN, _E.NONE,
               differs="none: NVIDIA says no GPU reset is needed"),
    164: Entry("power smoothing low lifetime", _A.NONE_GIVEN, _E.NONE,
               differs="reported: NVIDIA asks to watch power swings, not to stop the GPU"),
    165: Entry("power smoothing lifetime exhausted", _A.NONE_GIVEN, _E.NONE,
               differs="reported: NVIDIA asks to replace the GPU only where power swings "
                       "are not acceptable, a site decision"),
    166: Entry("NVLink traffic before encryption set up", _A.NONE_GIVEN, _E.NONE,
               differs="confidential computing mode only: reported"),
    167: Entry("PCIe fatal timeout", _A.NONE_GIVEN, _E.BOOT,
               differs="no action in the catalogue; ours: the GPU lost its PCIe link, as "
                       "with Xid 79, so only a new boot ends it"),
    168: Entry("errors in the write-protected region", _A.NONE_GIVEN, _E.BOOT,
               differs="no action bucket; NVIDIA's text: enable ECC or boot again"),
    169: Entry("SEC2 micro-controller halt", _A.NONE_GIVEN, _E.RESET,
               differs="no action in the catalogue; ours: a micro-controller halt, as Xid "
                       "62 (RESET_GPU)"),
    170: Entry("interrupt in confidential computing mode", _A.NONE_GIVEN, _E.NONE,
               differs="confidential computing mode only: reported"),
    171: Entry("uncorrectable DRAM error", _A.NONE_GIVEN, _E.RESET,
               differs="no action in the catalogue; it details an Xid 48, so it ends as 48"),
    172: Entry("uncorrectable SRAM error", _A.NONE_GIVEN, _E.RESET,
               differs="no action in the catalogue; it details an Xid 48, so it ends as 48"),
}

# Kept for the drain reasons and older callers.
MEANINGS: dict[int, str] = {x: e.meaning for x, e in ENTRIES.items()}
ACTIONS: dict[int, Action] = {x: e.action for x, e in ENTRIES.items()}
DEFAULT_FATAL: frozenset[int] = frozenset(x for x, e in ENTRIES.items() if e.ending)
NVLINK_RANGE = range(144, 151)


def meaning(xid: int) -> str:
    return MEANINGS.get(xid, "unlisted Xid")


def action(xid: int) -> Action:
    return ACTIONS.get(xid, Action.UNKNOWN)


def fatal_set(fatal: tuple[int, ...] = (), extra: tuple[int, ...] = (),
              not_fatal: tuple[int, ...] = ()) -> frozenset[int]:
    """The effective fatal list from the site's settings."""
    base = frozenset(fatal) if fatal else DEFAULT_FATAL
    return (base | frozenset(extra)) - frozenset(not_fatal)


@dataclass(frozen=True)
class Judgement:
    """One event judged: what ends it (NONE: not fatal), NVIDIA's action for it, and what
    in the message decided a decoded Xid."""

    ending: Ending
    action: str
    basis: str = ""


_DECODED_ENDING = {xid_decode.IGNORE: Ending.NONE, xid_decode.SYMPATHETIC: Ending.NONE,
                   xid_decode.RESTART_APP: Ending.NONE, xid_decode.XID_154_EVAL: Ending.NONE,
                   xid_decode.RESET_GPU: Ending.RESET, xid_decode.RESTART_BM: Ending.BOOT}


def judge(xid: int, text: str, fatal: frozenset[int]) -> Judgement:
    """What ends this event, from the catalogue, the message (74, 144-150, 154) and the
    site's fatal list."""
    entry = ENTRIES.get(xid)
    act = entry.action.value if entry else Action.UNKNOWN.value
    if xid not in fatal:
        return Judgement(Ending.NONE, act)
    decoded: xid_decode.Decoded | None = None
    if xid == 74:
        decoded = xid_decode.decode_74(text)
    elif xid in NVLINK_RANGE:
        decoded = xid_decode.decode_nvlink5(xid, text)
        if decoded is None:  # not in NVIDIA's table: the driver's own word decides
            word = "Nonfatal" if " Nonfatal " in f" {text} " else "Fatal"
            decoded = xid_decode.Decoded(
                xid_decode.IGNORE if word == "Nonfatal" else xid_decode.RESET_GPU,
                f"not in NVIDIA's decode table; the driver says {word}")
    elif xid == 154:
        decoded = xid_decode.decode_154(text)
    if decoded is not None:
        return Judgement(_DECODED_ENDING[decoded.action], decoded.action, decoded.basis)
    if entry is None or not entry.ending:
        return Judgement(Ending.RESET, act, "on the site's fatal list")
    return Judgement(entry.ending, act)


def is_fatal(xid: int, text: str, fatal: frozenset[int]) -> bool:
    """Whether one event drains, using what the driver's message itself says where it can."""
    return bool(judge(xid, text, fatal).ending)
