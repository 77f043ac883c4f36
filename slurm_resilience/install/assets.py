"""Where the files shipped beside the package are: a checkout, or an installed wheel.

A wheel installs them as data files under ``<prefix>/share/slurm-resilience``
(setup.cfg ``[options.data_files]``); a checkout (an editable install) keeps them
at the top level, which stays their single source.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DIST = "slurm-resilience"
SHARE = Path("share") / "slurm-resilience"
HOOKS = ("prolog", "epilog", "healthcheck")
SPANK_SOURCES = ("slurm_resilience_spank.c", "Makefile", "exports.map")
UNIT = "slurm-resilience-agent.service"
HOOKS_UNIT = "slurm-resilience-hooks.service"  # the hook server (hooks.server: service)
EXAMPLE_CONFIG = "config.example.yaml"
JOB_SUBMIT = "job_submit.lua"


class AssetError(RuntimeError):
    """The shipped files could not be found; the message lists where they were looked for."""


@dataclass(frozen=True)
class Assets:
    """The three directories of shipped files (same names in a checkout and a wheel)."""

    root: Path
    origin: str  # "checkout" or "installed"

    @property
    def hooks(self) -> Path:
        return self.root / "hooks"

    @property
    def spank(self) -> Path:
        return self.root / "spank"

    @property
    def conf(self) -> Path:
        return self.root / "conf"

    def missing(self) -> list[Path]:
        wanted = ([self.hooks / h for h in (*HOOKS, JOB_SUBMIT)]
                  + [self.spank / s for s in SPANK_SOURCES]
                  + [self.conf / UNIT, self.conf / HOOKS_UNIT, self.conf / EXAMPLE_CONFIG])
        return [p for p in wanted if not p.is_file()]


def _checkout_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _installed_root() -> Path | None:
    """The data directory recorded in the distribution's RECORD (any install scheme)."""
    try:
        files = metadata.distribution(DIST).files or []
    except metadata.PackageNotFoundError:
        return None
    marker = (SHARE / "hooks" / "prolog").as_posix()
    for f in files:
        if f.as_posix().endswith(marker):
            return Path(str(f.locate())).resolve().parents[1]
    return None


def find() -> Assets:
    """The shipped files of this installation; AssetError when any is missing."""
    candidates: list[Assets] = []
    root = _checkout_root()
    if (root / "setup.cfg").is_file() and (root / "hooks").is_dir():
        candidates.append(Assets(root, "checkout"))
    installed = _installed_root()
    if installed is not None:
        candidates.append(Assets(installed, "installed"))
    candidates.append(Assets(Path(sys.prefix) / SHARE, "installed"))
    for cand in candidates:
        if not cand.missing():
            return cand
    looked = "; ".join(f"{c.root} (missing {', '.join(str(p) for p in c.missing()[:3])})"
                       for c in candidates)
    raise AssetError(f"install: couldn't find the files shipped with {DIST}: looked in {looked}; "
                     f"reinstall the wheel")
