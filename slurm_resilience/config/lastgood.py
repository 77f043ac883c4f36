"""Keep gating when the configuration file breaks: a root-only copy of the last file that
loaded, and what to run with when the file in use does not load.

A typo in the YAML must not switch the gate off. Every root process that loads the file
(hooks, the hook server, the agent) saves its text here when it loaded and differs from
the copy; when the file fails to load, they gate with this copy (or, on a node where no
copy was ever saved, the built-in defaults) and say so: an error log event naming the
file, line and key, ``status``, and the agent's ``slurm_resilience_config_valid``.

The copies live in a fixed root-only directory, one per configuration file (named by a
hash of its real path), because the state directory is itself a setting of the file that
failed to load.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from dataclasses import dataclass

from slurm_resilience import config
from slurm_resilience.config.loader import ConfigError, load_text
from slurm_resilience.config.schema import Config

NODE_STORE_DIR = "/var/lib/slurm-resilience/last-good-config"
STORE_DIR = NODE_STORE_DIR  # tests point it elsewhere
BUILT_IN = "built-in defaults"
MAX_BYTES = 1 << 20  # a config file is a few KiB; a larger copy is not ours


@dataclass(frozen=True)
class Loaded:
    """The configuration a process runs with, and how it got it.

    ``error``: why the file in use did not load (None when it did); ``gating_with``: what
    the process runs with instead (the last good copy's path, or :data:`BUILT_IN`)."""

    cfg: Config
    source: str
    error: ConfigError | None = None
    gating_with: str = ""

    @property
    def valid(self) -> bool:
        return self.error is None

    def problem(self) -> str:
        """One line for logs, stderr and ``status``: what broke and what runs instead."""
        if self.error is None:
            return ""
        return f"{self.error}; gating with {self.gating_with}"

    def fields(self) -> dict[str, object]:
        """Log fields of an invalid configuration: the file, line and key that failed."""
        if self.error is None:
            return {}
        return {"file": self.error.source, "line": self.error.line,
                "key": self.error.path or None, "why": self.error.message,
                "gating_with": self.gating_with}


def copy_path(source: str, store: str | None = None) -> str:
    """Where the last good copy of the configuration file ``source`` is kept."""
    store = store or STORE_DIR
    digest = hashlib.sha256(os.path.realpath(source).encode()).hexdigest()[:16]
    return os.path.join(store, f"{digest}.yaml")


def _read_copy(path: str) -> str | None:
    """The copy's text, only if it is a regular file of this uid that no one else may
    write (a planted file or link is ignored); None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o022 or st.st_size > MAX_BYTES):
            return None
        return fh.read(MAX_BYTES).decode("utf-8", errors="replace")


def save(source: str, text: str, store: str | None = None) -> bool:
    """Keep ``text`` (which loaded) as ``source``'s last good copy, when it differs from
    the copy there; True when written. Only root keeps copies: a user's CLI run skips it."""
    store = store or STORE_DIR
    if os.geteuid() != 0 and store == NODE_STORE_DIR:
        return False
    path = copy_path(source, store)
    if _read_copy(path) == text:
        return False
    with contextlib.suppress(FileExistsError):
        os.makedirs(os.path.dirname(store), mode=0o755, exist_ok=True)
        os.mkdir(store, 0o700)
    st = os.lstat(store)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise OSError(f"{store} must be a directory of uid {os.geteuid()} with mode 0700 "
                      f"(is {stat.filemode(st.st_mode)}, uid {st.st_uid})")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(text.encode())
    os.replace(tmp, path)
    return True


def load(path: str | None = None, store: str | None = None) -> Loaded:
    """The configuration to gate with: the file in use when it loads (its copy refreshed),
    else its last good copy, else the built-in defaults; never an exception for a bad
    file, so a caller always has checks to run."""
    source, _ = config.locate(path)
    try:
        text = config.read(path)
        cfg = load_text(Config, text, source) if text is not None else Config()
    except ConfigError as exc:
        copy = copy_path(source, store)
        kept = _read_copy(copy)
        if kept is not None:
            try:
                return Loaded(load_text(Config, kept, copy), source, exc, copy)
            except ConfigError:
                pass  # a copy that no longer loads (an upgrade removed a key): defaults
        return Loaded(Config(), source, exc, BUILT_IN)
    if text is not None:
        try:
            save(source, text, store)
        except OSError as exc:  # a read-only /var/lib must not stop the gate; said, though
            from slurm_resilience.log import get_logger

            get_logger("config").warning(
                "config: couldn't keep a last good copy; a later broken file gates with the "
                "built-in defaults instead", source=source, error=str(exc))
    return Loaded(cfg, source)
