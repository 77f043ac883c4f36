"""State of the systemd units the GPUs depend on (Fabric Manager, IMEX, NVLSM,
persistenced): ``systemctl is-active UNIT``, one bounded call per unit."""

from __future__ import annotations

import shutil
from typing import Any

from slurm_resilience.proc import CommandError, Runner


def collect(units: list[str], timeout: float, runner: Runner | None = None
            ) -> dict[str, Any]:
    """``{"units": {unit: state}, "error"}``; state is systemctl's word (active, failed,
    inactive, activating...), or ``error: ...`` when it could not be asked."""
    if not units:
        return {"units": {}, "error": None}
    if shutil.which("systemctl") is None:
        return {"units": {}, "error": "systemctl not found (not a systemd host)"}
    run = runner or Runner()
    states: dict[str, str] = {}
    for unit in units:
        try:
            # is-active exits non-zero for every state but active: its stdout is the answer.
            done = run.run(["systemctl", "is-active", "--", unit], timeout=timeout,
                           check=False)
            states[unit] = done.stdout.strip().splitlines()[0] if done.stdout.strip() \
                else f"error: exit {done.returncode}"
        except CommandError as exc:
            states[unit] = f"error: {str(exc).splitlines()[0]}"
    return {"units": states, "error": None}
