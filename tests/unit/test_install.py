"""`slurm-resilience install`: the wheel carries what a node needs, and installs it idempotently.

The wheel is built from this checkout and installed into a fresh virtualenv that
is run from outside the checkout, so the files can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from slurm_resilience.install import assets, spank, targets
from slurm_resilience.install.files import Action, ensure_line, place
from slurm_resilience.proc import Runner

REPO = Path(__file__).resolve().parents[2]
SHIPPED = {f"hooks/{h}" for h in (*assets.HOOKS, assets.JOB_SUBMIT)} | {
    f"spank/{s}" for s in assets.SPANK_SOURCES} | {
    f"conf/{assets.UNIT}", f"conf/{assets.HOOKS_UNIT}", f"conf/{assets.EXAMPLE_CONFIG}"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whl")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(REPO)], check=True,
                   capture_output=True)
    (whl,) = out.glob("slurm_resilience-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with only the wheel; its dependencies come from ours through PYTHONPATH."""
    root = tmp_path_factory.mktemp("venv") / "sr"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    return root


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
           "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    return subprocess.run([str(venv / "bin" / "slurm-resilience"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)


def test_wheel_carries_hooks_spank_source_unit_and_example(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.split("/share/slurm-resilience/", 1)[1] for n in names
               if "/share/slurm-resilience/" in n}
    assert shipped >= SHIPPED, SHIPPED - shipped


def test_sdist_carries_them_too(tmp_path: Path) -> None:
    from setuptools import build_meta

    old = Path.cwd()
    os.chdir(REPO)
    try:
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(old)
    with tarfile.open(tmp_path / name) as tar:
        shipped = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert shipped >= SHIPPED, SHIPPED - shipped


def test_role_uses_no_controller_path_or_fixed_architecture() -> None:
    """Targets get the wheel: nothing in the role may point at the playbook's checkout, and
    the SPANK plugin directory comes from the target's Slurm."""
    for path in (REPO / "ansible").rglob("*.yml"):
        text = path.read_text()
        assert "playbook_dir" not in text, path
        assert "x86_64" not in text, path


def test_install_node_from_the_wheel_alone_then_nothing_changes(venv: Path,
                                                               tmp_path: Path) -> None:
    """Run from the installed wheel outside the checkout: hooks, unit (ExecStart in this
    prefix) and example land; a second run changes nothing; a tampered hook is restored."""
    args = ["install", "node", "--prefix", str(venv), "--config-dir", str(tmp_path / "etc"),
            "--systemd-dir", str(tmp_path / "systemd"), "--json"]
    first = _run(venv, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["changed"] and {f["action"] for f in report["files"]} == {"created"}
    for hook in assets.HOOKS:
        path = venv / "hooks" / hook
        assert os.access(path, os.X_OK)
        assert path.read_bytes() == (REPO / "hooks" / hook).read_bytes()
    unit = (tmp_path / "systemd" / assets.UNIT).read_text()
    assert f"ExecStart={venv}/bin/slurm-resilience agent\n" in unit
    hooks_unit = (tmp_path / "systemd" / assets.HOOKS_UNIT).read_text()
    assert f"ExecStart={venv}/bin/python3 -I -m slurm_resilience.hooks.server\n" in hooks_unit
    assert (tmp_path / "etc" / assets.EXAMPLE_CONFIG).is_file()

    second = json.loads(_run(venv, *args, cwd=tmp_path).stdout)
    assert not second["changed"]
    (venv / "hooks" / "epilog").write_text("#!/bin/sh\nexit 0\n")
    third = json.loads(_run(venv, *args, cwd=tmp_path).stdout)
    assert [f["path"] for f in third["files"] if f["action"] == "updated"] == [
        str(venv / "hooks" / "epilog")]


def test_install_controller_puts_job_submit_lua_beside_slurm_conf(venv: Path,
                                                                tmp_path: Path) -> None:
    conf = tmp_path / "slurm" / "slurm.conf"
    out = _run(venv, "install", "controller", "--prefix", str(venv), "--slurm-conf", str(conf),
               "--config-dir", str(tmp_path / "etc"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (conf.parent / "job_submit.lua").read_bytes() == (
        REPO / "hooks" / "job_submit.lua").read_bytes()
    assert out.stdout.splitlines()[-1] == "2 of 2 changed"


def test_install_commands_explain_every_argument(venv: Path, tmp_path: Path) -> None:
    for target in ("node", "controller", "spank", "slurm-conf"):
        text = _run(venv, "install", target, "--help", cwd=tmp_path).stdout
        assert "--prefix PREFIX" in text and "(default:" in text
        assert "--dry-run" in text and "--uninstall" in text


def test_place_replaces_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    dest = tmp_path / "hook"
    dest.symlink_to(victim)
    assert place(dest, b"new", 0o755).action is Action.UPDATED
    assert victim.read_text() == "keep" and not dest.is_symlink()
    assert place(dest, b"new", 0o755).action is Action.UNCHANGED
    assert place(dest, b"new", 0o700).action is Action.UPDATED


def test_ensure_line_appends_once_and_keeps_the_rest(tmp_path: Path) -> None:
    stack = tmp_path / "plugstack.conf"
    stack.write_text("required /x/other.so")
    assert ensure_line(stack, "optional /p/slurm_resilience.so").changed
    assert not ensure_line(stack, "optional /p/slurm_resilience.so").changed
    assert stack.read_text() == "required /x/other.so\noptional /p/slurm_resilience.so\n"


def test_plugin_dir_comes_from_slurm_conf_then_from_libslurm(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n  PluginDir=/srv/slurm/plugins:/other # site build\n")
    assert spank.find_plugin_dir(Runner(), conf).path == Path("/srv/slurm/plugins")
    found = spank.find_plugin_dir(Runner(), tmp_path / "absent.conf")
    # Whatever the architecture: the directory that holds this host's auth plugins.
    assert any(p.name.startswith("auth_") for p in found.path.iterdir()), found
    assert "libslurm" in found.source or "pkg-config" in found.source


def test_spank_is_rebuilt_when_source_or_slurm_version_changes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in assets.SPANK_SOURCES:
        (src / name).write_bytes((REPO / "spank" / name).read_bytes())
    build = tmp_path / "build"
    version = spank.slurm_version(Runner())
    _, first = spank.build(Runner(), src, build, version)
    assert first.action is Action.CREATED
    _, again = spank.build(Runner(), src, build, version)
    assert again.action is Action.UNCHANGED
    _, upgraded = spank.build(Runner(), src, build, version + "-next")
    assert upgraded.action is Action.UPDATED and "Slurm version changed" in upgraded.detail
    with (src / "slurm_resilience_spank.c").open("a") as fh:
        fh.write("\n/* edited */\n")
    _, edited = spank.build(Runner(), src, build, version + "-next")
    assert "source changed" in edited.detail


def test_install_spank_places_plugin_and_lists_it_once(tmp_path: Path) -> None:
    src = assets.find()
    paths = targets.Paths(prefix=tmp_path, hooks_dir=tmp_path / "hooks",
                          config_dir=tmp_path / "etc", systemd_dir=None,
                          slurm_conf=tmp_path / "slurm.conf")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    where = targets.SpankPaths(build_dir=tmp_path / "build", plugin_dir=plugins,
                               plugstack=tmp_path / "plugstack.conf")
    first = targets.spank_plugin(src, paths, where, Runner())
    assert all(c.changed for c in first)
    assert (tmp_path / "plugstack.conf").read_text() == (
        f"optional {plugins / spank.PLUGIN}\n")
    assert not any(c.changed for c in targets.spank_plugin(src, paths, where, Runner()))


def test_install_node_dry_run_changes_nothing_and_uninstall_takes_everything_out(
        venv: Path, tmp_path: Path) -> None:
    """--dry-run reports what would be created and writes nothing; --uninstall removes
    every file install node placed, and the site programs' <hook>.site files."""
    hooks = tmp_path / "hooks"
    args = ["install", "node", "--prefix", str(venv), "--config-dir", str(tmp_path / "etc"),
            "--systemd-dir", str(tmp_path / "systemd"), "--hooks-dir", str(hooks), "--json"]
    preview = json.loads(_run(venv, *args, "--dry-run", cwd=tmp_path).stdout)
    assert preview["dry_run"] and {f["action"] for f in preview["files"]} == {"created"}
    assert not hooks.exists() and not (tmp_path / "systemd").exists()
    installed = json.loads(_run(venv, *args, cwd=tmp_path).stdout)
    (hooks / "healthcheck.site").write_text("/usr/sbin/nhc\n")
    gone = _run(venv, *args, "--uninstall", cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    removed = {f["path"] for f in json.loads(gone.stdout)["files"] if f["action"] == "removed"}
    assert removed == {f["path"] for f in installed["files"]} | {
        str(hooks / "healthcheck.site")}
    assert not list(hooks.iterdir()) and not list((tmp_path / "systemd").iterdir())


def test_install_controller_never_replaces_a_sites_job_submit_lua(venv: Path,
                                                                  tmp_path: Path) -> None:
    """A site's own job_submit.lua stays through install and uninstall; the report says so."""
    conf = tmp_path / "slurm" / "slurm.conf"
    conf.parent.mkdir()
    site = conf.parent / "job_submit.lua"
    site.write_text("-- the site's own\n")
    args = ["install", "controller", "--prefix", str(venv), "--slurm-conf", str(conf),
            "--config-dir", str(tmp_path / "etc"), "--json"]
    out = json.loads(_run(venv, *args, cwd=tmp_path).stdout)
    assert "the site's own job_submit.lua kept" in out["files"][0]["detail"]
    json.loads(_run(venv, *args, "--uninstall", cwd=tmp_path).stdout)
    assert site.read_text() == "-- the site's own\n"


def test_spank_uninstall_removes_plugin_line_and_build(tmp_path: Path) -> None:
    """install spank --uninstall takes out the plugin, only its plugstack.conf line, its build."""
    src = assets.find()
    paths = targets.Paths(prefix=tmp_path, hooks_dir=tmp_path / "hooks",
                          config_dir=tmp_path / "etc", systemd_dir=None,
                          slurm_conf=tmp_path / "slurm.conf")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text("required /usr/lib/site_spank.so\n")
    where = targets.SpankPaths(build_dir=tmp_path / "build", plugin_dir=plugins,
                               plugstack=plugstack)
    targets.spank_plugin(src, paths, where, Runner())
    preview = targets.spank_plugin(src, paths, where, Runner(), dry_run=True)
    assert not any(c.changed for c in preview)
    targets.remove_spank(paths, where, Runner())
    assert plugstack.read_text() == "required /usr/lib/site_spank.so\n"
    assert not (plugins / spank.PLUGIN).exists() and not where.build_dir.exists()
