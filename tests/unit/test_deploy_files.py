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


def _hooks_beside_the_package(tmp_path: Path, hook: str) -> Path:
    """A copy of the ``hook`` wrapper in tmp/hooks, finding this checkout's virtualenv as
    tmp/.venv (so ``<hook>.site`` can be written beside it without touching the checkout)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    shutil.copy2(REPO / "hooks" / hook, hooks / hook)
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    return hooks / hook


def _site_program(path: Path, log: Path, rc: int) -> None:
    path.write_text(f"#!/bin/sh\necho {path.name} >>{log}\nexit {rc}\n")
    path.chmod(0o755)


@pytest.mark.parametrize("site_rc", [0, 3])
def test_hook_wrapper_runs_the_sites_program_too_and_fails_when_it_fails(
        tmp_path: Path, site_rc: int) -> None:
    """With prolog.site naming a site's program, the wrapper runs it, then ours, and fails
    with the site program's status when that one failed (ours passed)."""
    wrapper = _hooks_beside_the_package(tmp_path, "prolog")
    log = tmp_path / "ran.log"
    _site_program(tmp_path / "site-prolog", log, site_rc)
    (wrapper.parent / "prolog.site").write_text(f"{tmp_path / 'site-prolog'}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n")
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESILIENCE_CONFIG": str(cfg),
           "SLURM_JOB_ID": "1", "SLURMD_NODENAME": "nodeX"}
    out = subprocess.run([str(wrapper)], env=env, capture_output=True, text=True, check=False)
    assert log.read_text() == "site-prolog\n"
    assert '"event": "hook ok"' in (tmp_path / "ev.jsonl").read_text()  # ours ran too
    assert out.returncode == site_rc, out.stderr
    if site_rc:
        assert f"the site's {tmp_path / 'site-prolog'} exited 3" in out.stderr


def test_hook_wrapper_runs_a_site_glob_in_reverse_alphabetical_order(tmp_path: Path) -> None:
    """A site's `Prolog=/dir/*` keeps Slurm's order under our wrapper: z-a, each program once."""
    wrapper = _hooks_beside_the_package(tmp_path, "epilog")
    log = tmp_path / "ran.log"
    site = tmp_path / "epilog.d"
    site.mkdir()
    for name in ("10-first", "50-middle", "90-last"):
        _site_program(site / name, log, 0)
    (wrapper.parent / "epilog.site").write_text(f"{site}/*\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"logging:\n  file: {tmp_path}/ev.jsonl\n  syslog: false\n")
    env = {"PATH": "/usr/bin:/bin", "SLURM_RESILIENCE_CONFIG": str(cfg),
           "SLURM_JOB_ID": "1", "SLURMD_NODENAME": "nodeX"}
    out = subprocess.run([str(wrapper)], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert log.read_text().split() == ["90-last", "50-middle", "10-first"]
