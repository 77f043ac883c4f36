"""The training-side API: ``CheckpointManager``.

``save()`` stalls training only for a snapshot into reusable host buffers; a
background thread serialises, fsyncs and commits it to the job's node-local
staging dir, then all ranks agree on a separate gloo group and each node's
local rank 0 writes the step's commit marker. The node agent uploads committed
steps to S3 and stages the newest verified one back in when a job starts.
"""

from __future__ import annotations

import datetime
import os
import pwd
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    FileEntry,
    begin_part,
    commit_part,
    committed_steps,
    part_dirs,
    rank_name,
    remove_tree,
    step_name,
    verify_part,
    write_commit_marker,
)
from slurm_resilience.checkpoint.tensorfile import SKELETON, read_state, write_state

STATE_FILE = SKELETON
ENV_URI = "SLURM_RESILIENCE_CKPT_URI"
ENV_DIR = "SLURM_RESILIENCE_CKPT_DIR"


@dataclass(frozen=True)
class Loaded:
    """The newest complete step: its state (from ``save``) or its directory (``directory``)."""

    step: int
    path: Path
    state: Any = None


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return default


class _Snapshot:
    """Copies of a state dict's tensors in host buffers that are reused between saves."""

    def __init__(self) -> None:
        self.buffers: dict[str, Any] = {}

    def take(self, obj: Any, path: str = "") -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self.buffers.get(path)
            if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                    or buf.layout != t.layout or not t.is_contiguous()):
                buf = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format,
                                       pin_memory=t.is_cuda)
                self.buffers[path] = buf
            buf.copy_(t, non_blocking=t.is_cuda)
            return buf
        if isinstance(obj, Mapping):
            return {k: self.take(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self.take(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        import copy

        return copy.deepcopy(obj)


class CheckpointManager:
    """Saves and loads one rank's checkpoints in a job's staging dir."""

    def __init__(self, job_dir: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1,
                 local_leader: bool | None = None, uri: str | None = None,
                 job_id: int | None = None, agent_socket: str | None = None,
                 stagein_timeout_s: float = 600.0, barrier_timeout_s: float = 600.0):
        self.job_dir = Path(job_dir)
        self.rank = rank
        self.world_size = world_size
        self.local_leader = rank == 0 if local_leader is None else local_leader
        self.uri = uri
        self.job_id = job_id
        self.agent_socket = agent_socket
        self.stagein_timeout_s = stagein_timeout_s
        if not self.job_dir.is_dir():
            raise CheckpointError(
                f"checkpoint: staging dir {self.job_dir} does not exist; the prolog creates it "
                f"(is checkpoint.enabled set?), or set {ENV_DIR} outside Slurm")
        self._snap = _Snapshot()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        self.last_saved: int | None = None
        if world_size > 1:
            self._group = self._make_group(barrier_timeout_s)

    # -- construction from the job's environment -------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointManager:
        """Job id, rank, staging dir (config) and run URI from the environment."""
        env = dict(os.environ if env is None else env)
        from slurm_resilience import config
        from slurm_resilience.config.paths import node_name, node_path

        cfg = config.load(config.job_config_path(env))
        ck = cfg.checkpoint
        rank = _env_int(env, "RANK", "SLURM_PROCID", default=0)
        local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=rank)
        world = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1)
        job_id = _env_int(env, "SLURM_JOB_ID", "SLURM_JOBID", default=0) or None
        if _dist_ready():
            dist = sys.modules["torch"].distributed
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
        elif world > 1:
            raise CheckpointError(f"checkpoint: from_env: {world} tasks but torch.distributed "
                                  "is not initialised; call init_process_group() first")
        uri = env.get(ENV_URI) or None
        agent_socket = None
        if env.get(ENV_DIR):
            jdir = Path(env[ENV_DIR])
        elif job_id is not None:
            from slurm_resilience.checkpoint.staging import job_dir

            node = node_name(env.get("SLURMD_NODENAME") or cfg.node.name)
            jdir = job_dir(node_path(ck.staging_root, node), job_id)
            # Only a run with a URI has anything to stage in or upload.
            agent_socket = node_path(cfg.agent.socket, node) if uri else None
        else:
            raise CheckpointError(f"checkpoint: from_env: no SLURM_JOB_ID and no {ENV_DIR}; "
                                  "run under Slurm or name a local directory")
        if uri is not None:
            from slurm_resilience.checkpoint.prefix import check_run_uri

            check_run_uri(uri, ck.allowed_prefix, pwd.getpwuid(os.getuid()).pw_name)
        mgr = cls(jdir, rank=rank, world_size=world, local_leader=local_rank == 0, uri=uri,
                  job_id=job_id, agent_socket=agent_socket,
                  stagein_timeout_s=ck.stagein_timeout_s)
        if uri is not None and agent_socket is not None and job_id is not None:
            mgr._register()
        return mgr

    def _make_group(self, timeout_s: float) -> Any:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CheckpointError("checkpoint: world_size > 1 needs torch.distributed "
                                  "initialised before the CheckpointManager is created")
        # A group of our own, so the background thread never interleaves with training
        # collectives on the default group.
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def _register(self) -> None:
        from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

        assert self.agent_socket is not None
        try:
            call(self.agent_socket, "ckpt.register", job_id=self.job_id, uri=self.uri,
                 timeout=30.0)
        except AgentRefused as exc:
            raise CheckpointError(str(exc)) from None
        except AgentUnavailable as exc:
            print(f"checkpoint: register: couldn't reach the node agent ({exc}); checkpoints "
                  "stay on this node and nothing is staged in", file=sys.stderr)
            self.agent_socket = None

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, state_dict: Mapping[str, Any]) -> None:
        """Snapshot ``state_dict`` now; persist and commit it in the background."""
        self.wait()
        if (self.job_dir / step_name(step) / COMMIT).exists():
            print(f"checkpoint: save: step {step} is already committed; not overwriting",
                  file=sys.stderr)
            return
        snapshot = self._snap.take(state_dict)
        if any(getattr(b, "is_pinned", lambda: False)() for b in self._snap.buffers.values()):
            import torch

            torch.cuda.synchronize()
        self._thread = threading.Thread(target=self._persist, args=(step, snapshot),
                                        name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()

    def _persist(self, step: int, snapshot: Any) -> None:
        ok = False
        try:
            tmp = self._begin(step)
            entries = write_state(tmp, snapshot)
            commit_part(tmp, step, self.rank, known=entries)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._error = exc
        try:
            self._agree_and_mark(step, ok)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._error = self._error or exc

    def _begin(self, step: int) -> Path:
        _tmp, final = part_dirs(self.job_dir, step, self.rank)
        if final.exists() and not (final.parent / COMMIT).exists():
            remove_tree(final)  # an earlier run committed this part but the step never completed
        return begin_part(self.job_dir, step, self.rank)

    def _agree_and_mark(self, step: int, ok: bool) -> None:
        """All ranks committed? Then each node's local rank 0 writes the commit marker."""
        committed = 1 if ok else 0
        if self._group is not None:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([committed], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self._group)
            committed = int(flag.item())
        if committed == self.world_size:
            if self.local_leader:
                write_commit_marker(self.job_dir, step, self.world_size)
            self.last_saved = step
        elif ok:
            raise CheckpointError(f"checkpoint: save: step {step}: only {committed} of "
                                  f"{self.world_size} ranks committed; step left incomplete")

    def wait(self) -> None:
        """Block until the background save finished; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint: save failed: {err}") from err

    @contextmanager
    def directory(self, step: int) -> Iterator[Path]:
        """A fresh directory for this rank's files of ``step``; committed on clean exit."""
        self.wait()
        tmp = self._begin(step)
        ok = False
        try:
            yield tmp
            commit_part(tmp, step, self.rank)
            ok = True
        finally:
            self._agree_and_mark(step, ok)

    # -- loading ---------------------------------------------------------------------------

    def wait_stagein(self) -> dict[str, Any]:
        """Wait until the agent finished staging this job's newest step in."""
        if self.agent_socket is None or self.job_id is None:
            return {"state": "none"}
        from slurm_resilience.agent.client import AgentUnavailable, call

        deadline = time.monotonic() + self.stagein_timeout_s
        delay = 0.05
        while True:
            try:
                status = call(self.agent_socket, "ckpt.status", job_id=self.job_id)
            except AgentUnavailable as exc:
                print(f"checkpoint: stage-in: agent unavailable ({exc}); using local steps only",
                      file=sys.stderr)
                return {"state": "unavailable"}
            state = str(status.get("stagein", "none"))
            if state in ("done", "failed", "none"):
                if state == "failed":
                    print(f"checkpoint: stage-in failed: {status.get('error')}",
                          file=sys.stderr)
                return status
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint: load: stage-in still {state} after "
                                      f"{self.stagein_timeout_s:.0f}s (checkpoint."
                                      "stagein_timeout_s)")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def newest_local(self) -> int | None:
        """Newest committed step whose part for this rank verifies; corrupt ones are skipped."""
        for step in reversed(committed_steps(self.job_dir)):
            try:
                verify_part(self.job_dir / step_name(step) / rank_name(self.rank), step)
            except (CheckpointError, OSError) as exc:
                print(f"checkpoint: load: skipping step {step}: {exc}", file=sys.stderr)
                continue
            return step
        return None

    def load_latest(self, map_location: Any = "cpu", weights_only: bool = True
                    ) -> Loaded | None:
        """The newest step complete for every rank, or None when there is none."""
        self.wait()
        self.wait_stagein()
        step = self.newest_local()
        if self._group is not None:
            import torch
            import torch.distributed as dist

            t = torch.tensor([-1 if step is None else step], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
            agreed = int(t.item())
            step = None if agreed < 0 else agreed
            if step is not None:
                verify_part(self.job_dir / step_name(step) / rank_name(self.rank), step)
        if step is None:
            return None
        part = self.job_dir / step_name(step) / rank_name(self.rank)
        state = None
        if (part / STATE_FILE).is_file():
            state = read_state(part, map_location=map_location, weights_only=weights_only)
        self.last_saved = step
        return Loaded(step=step, path=part, state=state)

    def close(self) -> None:
        """Finish the pending save (call before exiting)."""
        self.wait()


def _dist_ready() -> bool:
    if "torch" not in sys.modules:
        return False
    dist = sys.modules["torch"].distributed
    return bool(dist.is_available() and dist.is_initialized())


__all__ = ["CheckpointError", "CheckpointManager", "FileEntry", "Loaded"]
