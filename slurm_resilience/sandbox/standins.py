"""Text of the sandbox's file and command stand-ins: ``/proc/modules``, ``nvme smart-log
-o json``, and the ``nvme`` and ``systemctl`` programs the health check runs.

Each sandbox node has its own copy under ``<state>/nodes/<node>/`` (see
:mod:`slurm_resilience.sandbox.hardware`); faults edit the data files, never the
programs.
"""

from __future__ import annotations

import json
from typing import Any

# The GPU service units the stand-in systemctl knows, all active on a healthy node (an HGX
# H100 runs Fabric Manager; persistenced keeps the driver loaded between jobs).
UNITS = ("nvidia-fabricmanager", "nvidia-persistenced")

# /proc/modules of an HGX H100 node with GPUDirect RDMA through nvidia_peermem:
# "name size refcount deps state address [taint]" (deps end with a comma, "-" for none).
# Addresses read 0 as they do for a reader without CAP_SYSLOG (kptr_restrict); the sizes
# are of the order the modules have, not taken from one capture.
_MODULES = (
    ("nvidia_peermem", 16384, 0, "", "(OE)"),
    ("nvidia_uvm", 4956160, 8, "", "(OE)"),
    ("nvidia_drm", 122880, 0, "", "(OE)"),
    ("nvidia_modeset", 1355776, 1, "nvidia_drm", "(OE)"),
    ("nvidia", 54308864, 163, "nvidia_uvm,nvidia_peermem,nvidia_modeset", "(OE)"),
    ("mlx5_ib", 479232, 0, "", ""),
    ("ib_uverbs", 196608, 3, "nvidia_peermem,rdma_ucm,mlx5_ib", ""),
    ("mlx5_core", 2248704, 1, "mlx5_ib", ""),
    ("ib_core", 483328, 8, "nvidia_peermem,rdma_cm,ib_ipoib,iw_cm,ib_umad,rdma_ucm,"
                           "ib_uverbs,mlx5_ib", ""),
)


def proc_modules(*, peermem: bool) -> str:
    """``/proc/modules`` with or without nvidia_peermem (``rmmod nvidia_peermem`` drops its
    line, its name from the modules it used, and one reference from each of them)."""
    lines = []
    for name, size, refs, deps, taint in _MODULES:
        if name == "nvidia_peermem" and not peermem:
            continue
        used_by = deps.split(",") if deps else []
        if not peermem and "nvidia_peermem" in used_by:
            used_by.remove("nvidia_peermem")
            refs -= 1
        shown = ",".join(used_by) + "," if used_by else "-"
        line = f"{name} {size} {refs} {shown} Live 0x0000000000000000"
        lines.append(f"{line} {taint}" if taint else line)
    return "\n".join(lines) + "\n"


def smart_log(**changes: int) -> dict[str, Any]:
    """``nvme smart-log /dev/nvme0 -o json`` (nvme-cli's key names) of a healthy drive. The
    values are the healthy Sabrent Rocket 4.0 capture's (tests/fixtures/nvme/
    smartctl-a-json_nvme_sabrent-rocket4-1tb_healthy.json, read by smartctl);
    nvme-cli reports the temperature in kelvin."""
    log: dict[str, Any] = {
        "critical_warning": 0, "temperature": 321, "avail_spare": 100, "spare_thresh": 5,
        "percent_used": 4, "endurance_grp_critical_warning_summary": 0,
        "data_units_read": 28337502, "data_units_written": 76471882,
        "host_read_commands": 294243226, "host_write_commands": 733021025,
        "controller_busy_time": 1635, "power_cycles": 1815, "power_on_hours": 8733,
        "unsafe_shutdowns": 39, "media_errors": 0, "num_err_log_entries": 4871,
        "warning_temp_time": 0, "critical_comp_time": 0,
    }
    log.update(changes)
    return log


def smart_log_json(**changes: int) -> str:
    return json.dumps(smart_log(**changes), indent=2) + "\n"


# The programs, found first on the health check's PATH (the sandbox's healthcheck wrapper
# puts <node>/bin there). Each reads the data files beside it.
_NVME = """#!/bin/sh
# Sandbox stand-in for nvme-cli: only `nvme smart-log DEVICE -o json`, answered from
# ../nvme-smart-log.json (faults edit that file).
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
if [ "$1" != smart-log ]; then
    echo "sandbox nvme: only 'smart-log DEVICE -o json' is stood in" >&2
    exit 1
fi
exec cat -- "$here/nvme-smart-log.json"
"""

_SYSTEMCTL = """#!/bin/sh
# Sandbox stand-in for systemd's systemctl: only `systemctl is-active [--] UNIT...`, from
# ../systemd/<unit> (one state word). Prints each unit's state; exits 0 when all are
# active, 3 when one is not, 4 for a unit it doesn't know (printed "inactive"), as
# systemctl(1) documents.
here=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
if [ "$1" != is-active ]; then
    echo "sandbox systemctl: only 'is-active UNIT' is stood in" >&2
    exit 1
fi
shift
[ "$1" = -- ] && shift
rc=0
for unit in "$@"; do
    unit=${unit%.service}
    case $unit in
        */*|.*|'') state= ;;
        *) state=$(cat -- "$here/systemd/$unit" 2>/dev/null) ;;
    esac
    if [ -z "$state" ]; then
        echo inactive
        rc=4
    else
        echo "$state"
        [ "$state" = active ] || [ "$rc" -ne 0 ] || rc=3
    fi
done
exit $rc
"""

SCRIPTS = {"nvme": _NVME, "systemctl": _SYSTEMCTL}
