"""How a job's agents exchange their pieces of an incident: the :class:`Rendezvous` seam.

The watcher is written against the Protocol only. :class:`DirRendezvous` is the
shared-directory mode (a root-writable directory every node's agent sees);
:class:`NoRendezvous` keeps each node to itself. The network mode (munge-authenticated
TCP between agents) plugs in through :func:`make`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from slurm_resilience import safefs
from slurm_resilience.config import Config
from slurm_resilience.config.paths import node_path
from slurm_resilience.hang.incidentrecords import MAX_PIECE_BYTES
from slurm_resilience.hang.steps import remove_tree
from slurm_resilience.log import get_logger

log = get_logger("heartbeat.rendezvous")

Sleep = Callable[[float], None]


class Rendezvous(Protocol):
    def publish(self, job_id: int, run: int, batch_host: str, nodes: Sequence[str],
                piece: bytes) -> None:
        """Make this node's piece (<= 64 KiB, opaque JSON bytes) for the job's run
        available to the batch host's agent. Never blocks longer than the implementation's
        own bounded send timeout; failures are logged, not raised."""

    def gather(self, job_id: int, run: int, nodes: Sequence[str], deadline: float,
               wait_for: Sequence[str] | None = None) -> dict[str, bytes]:
        """On the batch host: pieces of the other nodes of this run, waiting until those of
        ``wait_for`` (default: all of ``nodes``) are in or time.monotonic() passes deadline.
        Keys are node names (authenticated)."""

    def announced(self) -> list[tuple[int, int, str]]:
        """(job_id, run, node) for pieces that arrived for jobs whose batch host is this node
        since the last call: the watcher starts an incident for them."""

    def cleanup(self, older_than: float) -> int:
        """Forget pieces received before older_than (wall time); returns how many."""

    def close(self) -> None: ...


class NoRendezvous:
    """No exchange: the batch host sees only its own ranks (and says so in the report)."""

    def publish(self, job_id: int, run: int, batch_host: str, nodes: Sequence[str],
                piece: bytes) -> None:
        return None

    def gather(self, job_id: int, run: int, nodes: Sequence[str], deadline: float,
               wait_for: Sequence[str] | None = None) -> dict[str, bytes]:
        return {}

    def announced(self) -> list[tuple[int, int, str]]:
        return []

    def cleanup(self, older_than: float) -> int:
        return 0

    def close(self) -> None:
        return None


def _run_no(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):]
    return int(rest) if name.startswith(prefix) and rest.isdigit() else None


class DirRendezvous:
    """Pieces as root-owned files ``<dir>/job-<id>/run-<n>/<node>.json`` on a directory every
    agent can write as root (e.g. an admin NFS export without root squashing). Only files
    owned by root are read: a user who can write there cannot pose as an agent."""

    def __init__(self, directory: str, node: str, *, poll_s: float = 0.2,
                 sleep: Sleep = time.sleep, started: float | None = None):
        self.root = directory
        self.node = node
        self.poll_s = poll_s
        self.sleep = sleep
        # Only pieces written after the agent started are news (earlier runs' leftovers aren't).
        self.since = time.time() if started is None else started
        self.seen: set[tuple[int, int, str]] = set()

    def _run_dir(self, job_id: int, run: int) -> str:
        return os.path.join(self.root, f"job-{int(job_id)}", f"run-{int(run)}")

    def publish(self, job_id: int, run: int, batch_host: str, nodes: Sequence[str],
                piece: bytes) -> None:
        directory = self._run_dir(job_id, run)
        try:
            fd = safefs.makedirs_root(directory)
            try:
                safefs.replace_file(fd, f"{self.node}.json", piece[:MAX_PIECE_BYTES])
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("heartbeat: rendezvous: couldn't publish piece", path=directory,
                        error=str(exc))

    def _read(self, job_id: int, run: int, node: str) -> bytes | None:
        try:
            fd = safefs.open_dir(self._run_dir(job_id, run))
        except FileNotFoundError:
            return None
        try:
            return safefs.read_owned_file(fd, f"{node}.json", os.geteuid(),
                                          max_bytes=MAX_PIECE_BYTES)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def gather(self, job_id: int, run: int, nodes: Sequence[str], deadline: float,
               wait_for: Sequence[str] | None = None) -> dict[str, bytes]:
        pieces: dict[str, bytes] = {}
        wanted = [n for n in (nodes if wait_for is None else wait_for) if n != self.node]
        while True:
            for node in wanted:
                if node in pieces:
                    continue
                try:
                    data = self._read(job_id, run, node)
                except OSError as exc:
                    log.warning("heartbeat: rendezvous: couldn't read piece", node=node,
                                error=str(exc))
                    continue
                if data is not None:
                    pieces[node] = data
            if len(pieces) == len(wanted) or time.monotonic() > deadline:
                return pieces
            self.sleep(self.poll_s)

    def announced(self) -> list[tuple[int, int, str]]:
        out: list[tuple[int, int, str]] = []
        try:
            fd = safefs.open_dir(self.root)
        except FileNotFoundError:
            return out
        except OSError as exc:
            log.warning("heartbeat: rendezvous: couldn't open directory", path=self.root,
                        error=str(exc))
            return out
        try:
            for job_name in os.listdir(fd):
                job_id = _run_no(job_name, "job-")
                if job_id is None:
                    continue
                job_dir = os.path.join(self.root, job_name)
                try:
                    runs = [r for r in (_run_no(n, "run-") for n in os.listdir(job_dir))
                            if r is not None]
                except OSError:
                    continue
                for run in runs:
                    run_dir = self._run_dir(job_id, run)
                    try:
                        if os.stat(run_dir, follow_symlinks=False).st_mtime < self.since:
                            continue
                        names = os.listdir(run_dir)
                    except OSError:
                        continue
                    for name in names:
                        node = name[:-5]
                        key = (job_id, run, node)
                        if not name.endswith(".json") or node == self.node or key in self.seen:
                            continue
                        try:
                            st = os.stat(os.path.join(run_dir, name), follow_symlinks=False)
                        except OSError:
                            continue
                        if st.st_mtime >= self.since and st.st_uid == os.geteuid():
                            self.seen.add(key)
                            out.append(key)
        finally:
            os.close(fd)
        return out

    def cleanup(self, older_than: float) -> int:
        try:
            fd = safefs.open_dir(self.root)
        except FileNotFoundError:
            return 0
        removed = 0
        try:
            for name in os.listdir(fd):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if name.startswith("job-") and st.st_mtime < older_than:
                    removed += remove_tree(fd, name)
                    self.seen = {k for k in self.seen if f"job-{k[0]}" != name}
        finally:
            os.close(fd)
        return removed

    def close(self) -> None:
        return None


def make(cfg: Config, node: str,
         resolver: Callable[[Sequence[str]], dict[str, str]] | None = None) -> Rendezvous:
    """The configured exchange (``heartbeat.rendezvous``); ``resolver`` finds peers'
    addresses (the adapter's ``node_addresses``) for the network exchange."""
    hb = cfg.heartbeat
    mode = hb.rendezvous
    if mode == "network":
        from slurm_resilience.hang import netrendezvous as exchange

        try:
            made: Rendezvous = exchange.from_config(hb.exchange, node, resolver)
        except OSError as exc:
            # Pieces can still be sent to the batch host; only this node can't hear others.
            log.error("heartbeat: exchange: couldn't listen; other nodes' observations won't "
                      "reach this agent", port=hb.exchange.port_of(node), error=str(exc))
            made = exchange.from_config(hb.exchange, node, resolver, listen=False)
        return made
    if mode == "directory":
        if not hb.rendezvous_dir:
            log.error("heartbeat: rendezvous: couldn't use mode directory: rendezvous_dir is "
                      "empty; the batch host sees only its own ranks")
            return NoRendezvous()
        return DirRendezvous(node_path(hb.rendezvous_dir, node), node)
    return NoRendezvous()
