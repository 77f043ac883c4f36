"""Build the SPANK plugin against the target's Slurm and install it where that Slurm loads it.

The plugin is rebuilt when its source or the Slurm version changes: the build
directory keeps a stamp of both (source hash, ``slurmd -V``) and of the result.
The plugin directory comes from the target, never from a guess about its
architecture: ``PluginDir=`` in slurm.conf, else the directory of libslurm's
plugins (pkg-config's libdir, then where ``ldconfig`` finds libslurm).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from slurm_resilience.install import assets
from slurm_resilience.install.files import Action, Change, place
from slurm_resilience.proc import CommandError, Runner

PLUGIN = "slurm_resilience.so"
STAMP = "stamp.json"
# Every Slurm build has an auth plugin; it tells a plugin directory from any other.
_MARKER = re.compile(r"^auth_\w+\.so$")
_SUBDIRS = ("slurm-wlm", "slurm")  # Debian's name, then upstream's
_LIBSLURM = re.compile(r"^\s*libslurm\.so\S*\s.*=>\s*(\S+)\s*$")


class SpankError(RuntimeError):
    """The plugin can't be built or placed; the message names the cause."""


@dataclass(frozen=True)
class PluginDir:
    path: Path
    source: str  # how it was found, for the report


@dataclass(frozen=True)
class Stamp:
    source_sha256: str
    slurm_version: str
    plugin_sha256: str


def source_hash(spank_dir: Path) -> str:
    h = hashlib.sha256()
    for name in assets.SPANK_SOURCES:
        h.update(name.encode() + b"\0" + (spank_dir / name).read_bytes() + b"\0")
    return h.hexdigest()


def slurm_version(runner: Runner) -> str:
    """``slurmd -V`` (the daemon that loads the plugin), else a client's ``-V``."""
    errors = []
    for prog in ("slurmd", "srun", "scontrol"):
        try:
            out = runner.run([prog, "-V"], timeout=30).stdout.strip()
        except CommandError as exc:
            errors.append(str(exc))
            continue
        if out:
            return out
    raise SpankError(f"install spank: couldn't tell the Slurm version: {'; '.join(errors)}")


def _conf_plugin_dir(slurm_conf: Path) -> Path | None:
    try:
        text = slurm_conf.read_text()
    except FileNotFoundError:
        return None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        key, sep, value = line.partition("=")
        if sep and key.strip().lower() == "plugindir" and value.strip():
            return Path(value.strip().split(":")[0])
    return None


def _lib_dirs(runner: Runner) -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    try:
        libdir = runner.run(["pkg-config", "--variable=libdir", "slurm"], timeout=30).stdout.strip()
        if libdir:
            out.append((Path(libdir), "pkg-config slurm libdir"))
    except CommandError:
        pass  # no slurm.pc (Debian ships none): ldconfig below
    try:
        cache = runner.run(["ldconfig", "-p"], timeout=30,
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}).stdout
    except CommandError:
        cache = ""
    for line in cache.splitlines():
        m = _LIBSLURM.match(line)
        if m:
            out.append((Path(m.group(1)).resolve().parent, "libslurm's directory"))
    return out


def find_plugin_dir(runner: Runner, slurm_conf: Path) -> PluginDir:
    from_conf = _conf_plugin_dir(slurm_conf)
    if from_conf is not None:
        return PluginDir(from_conf, f"PluginDir= in {slurm_conf}")
    looked = []
    for libdir, how in _lib_dirs(runner):
        for sub in _SUBDIRS:
            cand = libdir / sub
            looked.append(str(cand))
            if cand.is_dir() and any(_MARKER.match(p.name) for p in cand.iterdir()):
                return PluginDir(cand, f"{how} ({libdir})")
    raise SpankError("install spank: couldn't find Slurm's plugin directory (no PluginDir= in "
                     f"{slurm_conf}; no auth_*.so in {', '.join(looked) or 'any libslurm dir'}); "
                     "pass --plugin-dir")


def read_stamp(build_dir: Path) -> Stamp | None:
    try:
        data = json.loads((build_dir / STAMP).read_text())
        return Stamp(str(data["source_sha256"]), str(data["slurm_version"]),
                     str(data["plugin_sha256"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def fresh_build(spank_src: Path, build_dir: Path, version: str) -> bytes | None:
    """The plugin already built from this source for ``version``, None when it needs a build."""
    built = build_dir / PLUGIN
    stamp = read_stamp(build_dir)
    if (stamp and stamp.source_sha256 == source_hash(spank_src)
            and stamp.slurm_version == version and built.is_file()):
        data = built.read_bytes()
        if hashlib.sha256(data).hexdigest() == stamp.plugin_sha256:
            return data
    return None


def build(runner: Runner, spank_src: Path, build_dir: Path, version: str) -> tuple[bytes, Change]:
    """The plugin built for ``version`` from ``spank_src``; rebuilt only when either changed."""
    want = source_hash(spank_src)
    built = build_dir / PLUGIN
    stamp = read_stamp(build_dir)
    if (stamp and stamp.source_sha256 == want and stamp.slurm_version == version
            and built.is_file() and hashlib.sha256(built.read_bytes()).hexdigest()
            == stamp.plugin_sha256):
        return built.read_bytes(), Change(built, Action.UNCHANGED, f"built for {version}")
    for name in assets.SPANK_SOURCES:
        place(build_dir / name, (spank_src / name).read_bytes(), 0o644)
    (build_dir / STAMP).unlink(missing_ok=True)
    try:
        runner.run(["make", "-B", "-C", str(build_dir), PLUGIN], timeout=600)
    except CommandError as exc:
        raise SpankError(f"install spank: build failed against {version} (needs gcc, make and "
                         f"Slurm's headers, Debian: libslurm-dev): {exc}") from exc
    data = built.read_bytes()
    reason = ("first build" if stamp is None else
              "source changed" if stamp.source_sha256 != want else
              "Slurm version changed" if stamp.slurm_version != version else "rebuilt")
    new = Stamp(want, version, hashlib.sha256(data).hexdigest())
    place(build_dir / STAMP, (json.dumps(new.__dict__, indent=1) + "\n").encode(), 0o644)
    return data, Change(built, Action.UPDATED if stamp else Action.CREATED,
                        f"{reason}: built for {version}")
