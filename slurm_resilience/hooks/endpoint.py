"""Where a node's hook server listens, and how a hook and the server talk.

The hook reads no configuration before it knows whether the server will run it (that
is most of the cost it avoids), so the socket's name is derived from what both sides
know without it: the configuration file a hook would load (its real path) and the
node's name. Everything here is stdlib and cheap to import.

Protocol, on a unix stream socket: the hook sends one frame (4-byte big-endian length,
then a JSON object ``{"v", "kind", "argv", "env", "cwd", "umask", "config"}``) with its
stdin, stdout and stderr attached (SCM_RIGHTS); the server answers ``started`` once a
worker is ready to run the hook. The hook then commits with ``go``: the worker runs only
after reading it, so a hook that gave up waiting (and runs itself) never has its steps run
a second time. The worker answers ``rc N`` when the hook ends, or ``abandoned: WHY`` when
no ``go`` came in time (nothing ran). Any other first line is a refusal (``busy``,
``stale``, ``refused: WHY``) and the hook runs in its own process.
"""

from __future__ import annotations

import os
import zlib

# Root-only directory (0700) for the servers' sockets: under /run, like the agent's.
SOCKET_DIR = "/run/slurm-resilience/hooks"
VERSION = 2
GO = b"go\n"
# How long a worker waits for the hook's go: the hook sends it as soon as it reads
# ``started``, so only a hook that already gave up (or is stuck) takes longer.
GO_TIMEOUT_S = 5.0
KINDS = ("prolog", "epilog", "healthcheck")
MAX_REQUEST_BYTES = 256 * 1024  # slurmd's hook environment is a few KiB
HEADER_BYTES = 4
# A unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL).
_MAX_PATH = 107


def config_key(config_path: str | None, default_path: str) -> str:
    """The file both sides mean: its real path (a link beside slurm.conf resolves to the
    file the agent was started with)."""
    return os.path.realpath(config_path or default_path)


def socket_path(config_real: str, node: str, directory: str = SOCKET_DIR) -> str:
    """``<dir>/<node>.<crc32 of the config's real path>.sock``: one per node and file, so
    sandboxes and nodes sharing a machine never meet. A collision of the checksum is
    caught by the server, which serves only its own file."""
    if "/" in node or node in ("", ".", ".."):
        raise ValueError(f"node name {node!r} cannot be used in a path")
    path = os.path.join(directory, f"{node[:48]}{_suffix(config_real)}")
    if len(path.encode()) > _MAX_PATH:
        raise ValueError(f"hook server socket path too long: {path}")
    return path


def _suffix(config_real: str) -> str:
    return f".{zlib.crc32(config_real.encode('utf-8', 'surrogateescape')):08x}.sock"


def nodes_serving(config_real: str, directory: str = SOCKET_DIR) -> list[str]:
    """The node names of the sockets in ``directory`` for this configuration file: where
    a hook found none under its own name, a server under another says the hook and the
    server disagree on the node's name."""
    suffix = _suffix(config_real)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n.removesuffix(suffix) for n in names if n.endswith(suffix))


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload
