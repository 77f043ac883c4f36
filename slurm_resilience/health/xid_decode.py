"""Decoding the Xids whose action depends on their message: 74, 144-150 and 154.

NVIDIA gives these no single immediate action. Its Xid Catalog sends 74 to the
WORKFLOW_NVLINK_ERR register decode, 144-150 to the "XID 144-150 Decode" table (keyed
by the sub-component named in the line, the error status and, for link-down events,
a reason field of IntrInfo) and 154 to the recovery action the line itself names. The
tables below carry NVIDIA's facts (bits, values, actions), not its text.

Line shapes (real GB200 and H100 lines in ``tests/fixtures/xid``)::

    NVLink: fatal error detected on link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)
    NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 0x00000000 ...)
    GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# What a decoded event asks for, weakest first; the catalogue maps these onto endings.
IGNORE = "IGNORE"
SYMPATHETIC = "SYMPATHETIC"  # a side effect of another failure: follow that one
RESTART_APP = "RESTART_APP"
XID_154_EVAL = "XID_154_EVAL"  # follow a companion Xid 154, else restart the application
RESET_GPU = "RESET_GPU"
RESTART_BM = "RESTART_BM"


@dataclass(frozen=True)
class Decoded:
    """NVIDIA's action for one line, and what in the line decided it."""

    action: str
    basis: str


# -- Xid 74: WORKFLOW_NVLINK_ERR (register bits, given by NVIDIA for Hopper) --------------
_XID74 = re.compile(r"link\s*(?P<link>-?\d+)\s*\((?P<regs>[^)]*)\)")
# (register index, bit) -> class. Registers are the 1st, 3rd, 4th and 5th of the seven.
_XID74_IGNORE = {(0, 0), (0, 23), (0, 30), (4, 20), (4, 23), (4, 26), (4, 29)}
_XID74_SYMPATHETIC = {(0, 1), (0, 20), (3, 16), (3, 17)}
# Bit 18 of the 4th register is sympathetic too, but NVIDIA adds that the fabric must be
# reset: it keeps the GPU out like any hardware bit.


def decode_74(text: str) -> Decoded:
    """Xid 74: drain unless every bit set is one NVIDIA calls safe to ignore (no action)
    or a side effect of another failure (that one drains). No registers read: drain."""
    m = _XID74.search(text)
    if not m:
        return Decoded(RESET_GPU, "no register values in the line")
    try:
        regs = [int(r, 16) for r in m["regs"].replace(",", " ").split()]
    except ValueError:
        return Decoded(RESET_GPU, "register values not readable")
    bits = {(i, b) for i, value in enumerate(regs) for b in range(32) if value >> b & 1}
    if not bits:
        return Decoded(RESET_GPU, "no error bit set")
    named = ", ".join(f"reg{i + 1} bit {b}" for i, b in sorted(bits))
    if bits <= _XID74_IGNORE:
        return Decoded(IGNORE, f"{named}: safe to ignore")
    if bits <= _XID74_IGNORE | _XID74_SYMPATHETIC:
        return Decoded(SYMPATHETIC, f"{named}: a side effect of another failure")
    return Decoded(RESET_GPU, f"{named}: a link fault (GPU reset or reboot clears it)")


# -- Xid 144-150: the "XID 144-150 Decode" table -------------------------------------
_NVLINK5 = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]+)\s+(?P<sev>Fatal|Nonfatal)\s+XC\d\s+i\d\s+Link\s+-?\d+\s*"
    r"\((?P<intr>0x[0-9a-fA-F]+)\s+(?P<status>0x[0-9a-fA-F]+)")
_I, _R, _E = IGNORE, RESET_GPU, XID_154_EVAL
_SW = 0x80000000  # every unit's software-reported status: IGNORE
# (Xid, unit) -> {error status bit value: action}. Unit names of both driver revisions.
_UNIT_STATUS: dict[tuple[int, str], dict[int, str]] = {
    (144, "SAW_MVB"): {0x1: _I, 0x2: _R, 0x4: _I, 0x8: _I, 0x10: _R, 0x20: _I},
    (145, "RLW_CTRL"): {},
    (145, "RLW_REMAP"): {0x1: _E, 0x2: _E, 0x4: _E, 0x8: _E, 0x10: _E, 0x20: _E, 0x40: _R,
                         0x80: _R, 0x100: _I, 0x200: _I},
    (145, "RLW_RSPCOL"): {0x1: _I, 0x2: _R},
    # 0x1-0x4 ask for a reset only with IntrInfo's "action 2" bit (see _action2).
    (145, "RLW_RXPIPE"): {0x1: _I, 0x2: _I, 0x4: _I, 0x8: _I},
    (145, "RLW_SRC_TRACK"): {0x1: _R, 0x2: _I, 0x4: _E, 0x8: _E, 0x10: _R, 0x20: _R},
    (145, "RLW_TAGSTATE"): {0x1: _I, 0x2: _R, 0x10000: _I, 0x20000: _R, 0x100000: _R},
    **{(146, unit): {0x1: _I, 0x2: _I, 0x4: _R}
       for unit in ("TLW_CTRL", "TLW_RX", "TLW_RX_PIPE0", "TLW_RX_PIPE1", "TLW_TX",
                    "TLW_TX_PIPE0", "TLW_TX_PIPE1")},
    (147, "TREX"): {0x1: _I},
    (148, "NVLPW_CTRL"): {}, (148, "NVLPW"): {},
    (149, "NETIR_BER_EVENT"): {0x0: _I, 0x1: _I, 0x2: _I, 0x3: _I},
    (149, "NETIR_MFDE_EVENT"): {0x1: _R, 0x3: _I, 0x4: _R, 0x5: _R, 0x7: _R},
}
# Units decided by the unit alone (every row of theirs has the same action).
_UNIT_ONLY = {(149, "NETIR"): _R, (149, "NETIR_INT"): _R, (150, "MSE_WATCHDOG"): _R,
              (150, "MSE"): _R}
# Xid 149 link-down events: the reason in IntrInfo bits 25:20 picks the row; two reasons
# are IGNORE (0x26 software/user, 0x28 a host-side secondary), every other one RESET_GPU.
_LINK_DOWN_UNITS = ("NETIR_LINK_EVT", "NETIR_LINK_DOWN")
_LINK_DOWN_IGNORE = {0x26, 0x28}
# Status values compared whole (not as bits) for these units.
_WHOLE_STATUS = {(149, "NETIR_BER_EVENT"), (149, "NETIR_MFDE_EVENT")}
_RANK = {IGNORE: 0, SYMPATHETIC: 1, RESTART_APP: 2, XID_154_EVAL: 3, RESET_GPU: 4,
         RESTART_BM: 5}


def _worst(actions: list[str]) -> str:
    return max(actions, key=lambda a: _RANK[a])


def _action2(intr: int) -> bool:
    """RLW_RXPIPE's "decode for action 2": the bit just above the sub-code (bit 10 of a
    driver before R575, whose sub-code sits in bits 9:5; bit 7 of R575+, bits 6:0)."""
    v1 = intr & 0x3FF == 0b0011000010
    return bool(intr >> 10 & 1) if v1 else bool(intr >> 7 & 1)


def decode_nvlink5(xid: int, text: str) -> Decoded | None:
    """NVIDIA's action for an Xid 144-150 line, or None when the line or its unit/status
    is not in the table (the caller then goes by the driver's Fatal/Nonfatal word)."""
    m = _NVLINK5.search(text)
    if not m:
        return None
    unit, intr, status = m["unit"], int(m["intr"], 16), int(m["status"], 16)
    where = f"{unit} status {status:#x}"
    if (xid, unit) in _UNIT_ONLY:
        return Decoded(_UNIT_ONLY[(xid, unit)], unit)
    if xid == 149 and unit in _LINK_DOWN_UNITS:
        reason = intr >> 20 & 0x3F
        action = IGNORE if reason in _LINK_DOWN_IGNORE else RESET_GPU
        return Decoded(action, f"{unit} link-down reason {reason:#04x}")
    table = _UNIT_STATUS.get((xid, unit))
    if table is None:
        return None
    if status == _SW:
        return Decoded(IGNORE, where)
    if (xid, unit) in _WHOLE_STATUS:
        found = table.get(status)
        return Decoded(found, where) if found else None
    bits = [1 << b for b in range(31) if status >> b & 1]
    if not bits or any(b not in table for b in bits):
        return None
    action = _worst([table[b] for b in bits])
    if unit == "RLW_RXPIPE" and status & 0x7 and _action2(intr):
        action = RESET_GPU
    return Decoded(action, where)


# -- Xid 154: the recovery action the driver names ------------------------------------
_RECOVERY = re.compile(r"\bto (?P<num>0x[0-9a-fA-F]+)(?: \((?P<name>[^)]*)\))?")
# nvmlDeviceGpuRecoveryAction_t: NONE, GPU_RESET, NODE_REBOOT, DRAIN_P2P, DRAIN_AND_RESET,
# RECOVER_IMEX_DOMAIN, BUS_RESET, SYSTEM_REBOOT.
RECOVERY_ACTIONS: dict[int, tuple[str, str]] = {
    0: ("NONE", IGNORE), 1: ("GPU_RESET", RESET_GPU), 2: ("NODE_REBOOT", RESTART_BM),
    3: ("DRAIN_P2P", RESET_GPU), 4: ("DRAIN_AND_RESET", RESET_GPU),
    5: ("RECOVER_IMEX_DOMAIN", RESET_GPU), 6: ("BUS_RESET", RESET_GPU),
    7: ("SYSTEM_REBOOT", RESTART_BM),
}


def recovery_action(value: int) -> tuple[str, str]:
    """NVML's recovery action value → (its name, the action it asks of us). A value newer
    than this table asks for a reset: never less than the driver might mean."""
    return RECOVERY_ACTIONS.get(value, (f"action {value}", RESET_GPU))


def decode_154(text: str) -> Decoded:
    """Xid 154: the action it changed *to*. Drivers word it differently ("Node Reboot
    Required", "OS Reboot", "PF FLR"), so the words decide where they name a reboot or a
    reset, and the number otherwise."""
    m = _RECOVERY.search(text)
    if not m:
        return Decoded(RESET_GPU, "recovery action not readable")
    name = (m["name"] or "").strip()
    words = name.lower()
    num = int(m["num"], 16)
    label = f"{m['num']} ({name})" if name else m["num"]
    if "reboot" in words or "power cycle" in words:
        return Decoded(RESTART_BM, label)
    if "reset" in words or "flr" in words or "drain" in words:
        return Decoded(RESET_GPU, label)
    if words == "none" or (not words and num == 0):
        return Decoded(IGNORE, label)
    return Decoded(recovery_action(num)[1], label)
