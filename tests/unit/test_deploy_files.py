"""Files an admin deploys: the Ansible role, the systemd unit, the hook wrappers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ansible_playbook_passes_syntax_check() -> None:
    """ansible/site.yml and its role parse as a valid playbook."""
    exe = Path(sys.executable).with_name("ansible-playbook")
    if not exe.exists():
        pytest.fail("ansible-playbook missing from the virtualenv: run `make setup`")
    out = subprocess.run(
        [str(exe), "--syntax-check", "-i", "localhost,", str(REPO / "ansible" / "site.yml")],
        capture_output=True, text=True, check=False, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr


def test_systemd_unit_runs_the_agent() -> None:
    """The agent unit starts `slurm-resilience agent` and restarts it when it dies; it names
    no config file, so it finds the one the hooks find (beside the slurm.conf in use)."""
    text = (REPO / "conf" / "slurm-resilience-agent.service").read_text()
    assert "ExecStart=/opt/slurm-resilience/bin/slurm-resilience agent\n" in text
    assert "Environment=SLURM_CONF=/etc/slurm/slurm.conf" in text
    assert "Restart=always" in text
    if shutil.which("systemd-analyze"):
        out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                              str(REPO / "conf" / "slurm-resilience-agent.service")],
                             capture_output=True, text=True, check=False)
        # The ExecStart binary is absent on a build machine; only syntax errors matter.
        assert "Unknown key" not in out.stderr and "Invalid" not in out.stderr, out.stderr


def test_systemd_unit_runs_the_hook_server_in_the_hooks_mount_namespace() -> None:
    """The hook server's unit runs the package's server, restarts it, and sandboxes none of
    the mounts: its workers act for slurmd's hooks, in slurmd's mount namespace (the server
    refuses hooks from another one)."""
    path = REPO / "conf" / "slurm-resilience-hooks.service"
    text = path.read_text()
    assert "ExecStart=/opt/slurm-resilience/bin/python3 -I -m slurm_resilience.hooks.server\n" \
        in text
    assert "Environment=SLURM_CONF=/etc/slurm/slurm.conf" in text
    assert "Restart=always" in text and "Before=slurmd.service" in text
    settings = [line.split("=", 1)[0] for line in text.splitlines() if "=" in line
                and not line.startswith("#")]
    for private in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts",
                    "ReadOnlyPaths", "TemporaryFileSystem", "MountFlags"):
        assert private not in settings
    if shutil.which("systemd-analyze"):
        out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                             capture_output=True, text=True, check=False)
        assert "Unknown key" not in out.stderr and "Invalid" not in out.stderr, out.stderr


@pytest.mark.parametrize("hook", ["prolog", "epilog", "healthcheck"])
def test_hook_wrappers_are_executable_posix_sh(hook: str) -> None:
    """Each hook wrapper is executable, parses as POSIX sh, and runs the package with -I."""
    path = REPO / "hooks" / hook
    assert os.access(path, os.X_OK)
    subprocess.run(["sh", "-n", str(path)], check=True)
    assert f"-I -m slurm_resilience.hooks {hook}" in path.read_text()


def test_hook_wrapper_without_config_lets_job_run(tmp_path: Path) -> None:
    """The prolog wrapper runs the real package and exits 0 with a default-less empty config."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n")
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESILIENCE_CONFIG": str(cfg),
           "SLURM_JOB_ID": "1", "SLURMD_NODENAME": "nodeX"}
    out = subprocess.run([str(REPO / "hooks" / "prolog")], env=env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
