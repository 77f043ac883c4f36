"""The training-side API: ``CheckpointManager``, on torch.distributed.checkpoint (DCP).

``save()`` stalls training only for a snapshot into reused host buffers; a background
thread runs ``dcp.save`` through :class:`StagingWriter` on a gloo group of our own
(every rank's part durable, ``.metadata`` from the coordinator, COMMIT.json), and each
node's local leader writes its node's commit marker. ``load_latest(state)`` agrees on
one step across ranks and loads it in place with DCP's load planner, at any world
size. The node agent uploads committed steps to S3 and stages them back in.
"""

from __future__ import annotations

import datetime
import os
import pwd
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_resilience.checkpoint import choose_step as choose
from slurm_resilience.checkpoint import interrupt, loading
from slurm_resilience.checkpoint.app_state import train_state
from slurm_resilience.checkpoint.arrival import ArrivalCheck, for_group
from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CheckpointError,
    FileEntry,
    part_dirs,
    read_manifest,
    step_name,
    write_commit_marker,
)
from slurm_resilience.checkpoint.dcp_state import Snapshot, check_state, resolve_stateful
from slurm_resilience.checkpoint.loading import Loaded
from slurm_resilience.checkpoint.optin import ENV_ALLOW_FRESH, ENV_ALLOW_OLDER, env_flag
from slurm_resilience.checkpoint.quota import check_before_save
from slurm_resilience.checkpoint.ranges import LocalRanges, RangeSource
from slurm_resilience.checkpoint.rescue import (
    ENV_RESCUE,
    SHARDED,
    Rescue,
    drop_upto,
    keys_hash,
    rescue_root,
)
from slurm_resilience.checkpoint.stagein_status import (
    Fallen,
    StageinStatus,
    wait_stagein,
)
from slurm_resilience.heartbeat import attempt

ENV_URI = "SLURM_RESILIENCE_CKPT_URI"
ENV_DIR = "SLURM_RESILIENCE_CKPT_DIR"

# dcp.save/load without a process group (one process, no torch.distributed) warn on every call.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or "
                        "uninitialized", category=UserWarning)


def _env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return default


class CheckpointManager:
    """Saves and loads a job's DCP checkpoints in its node-local staging dir."""

    def __init__(self, job_dir: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1,
                 local_leader: bool | None = None, uri: str | None = None,
                 job_id: int | None = None, agent_socket: str | None = None,
                 stagein_timeout_s: float = 600.0, barrier_timeout_s: float = 600.0,
                 ranges: RangeSource | None = None, allow_fresh_start: bool = False,
                 keep_buffers: bool = True, allow_older_step: bool = False,
                 arrival_timeout_s: float = 30.0, quota_fraction: float | None = None,
                 rescue: bool = False):
        self.job_dir = Path(job_dir)
        # checkpoint.job_quota_fraction: a save past the job's share of the disk is refused.
        self.quota_fraction = quota_fraction
        self.rank = rank
        self.world_size = world_size
        self.local_leader = rank == 0 if local_leader is None else local_leader
        self.uri = uri
        self.job_id = job_id
        self.agent_socket = agent_socket
        self.stagein_timeout_s = stagein_timeout_s
        self.allow_fresh_start = allow_fresh_start
        # Told to the agent at register: after the bounded wait for a step still uploading
        # from nodes that may be dead, stage-in takes the newest complete older step.
        self.allow_older_step = allow_older_step
        # True: the snapshot buffers stay between saves (one copy of the state resident, no
        # page faults in the next stall); False: freed once each save is written.
        self.keep_buffers = keep_buffers
        self.ranges: RangeSource = ranges if ranges is not None else LocalRanges(self.job_dir)
        if not self.job_dir.is_dir():
            raise CheckpointError(
                f"checkpoint: staging dir {self.job_dir} does not exist; the prolog creates it "
                f"(is checkpoint.enabled set?), or set {ENV_DIR} outside Slurm")
        self._snap = Snapshot()
        self._thread: threading.Thread | None = None
        self._future: Any = None
        self._error: BaseException | None = None
        self._group: Any = None
        self._stop_group: Any = None
        self._agent_lost: str | None = None  # why the agent of a run with a URI is unreachable
        self._save_report_failed = False
        self.last_saved: int | None = None
        # Steps this run loaded or saved: only these may a save() of the same number skip as
        # "already committed" (the same on every rank: both come from collective calls).
        self._trusted: set[int] = set()
        self._passed_over: dict[int, str] = {}  # steps load_latest found corrupt
        self._arrival: ArrivalCheck | None = None  # every rank calls save(), or it fails fast
        self.last_stall_s = 0.0  # the last save()'s stall, and the part of it spent
        self.last_wait_s = 0.0  # waiting for the previous save's write
        # A save at the fault (rescue.py): this node's rescues, and the step a restore took
        # from one (its reads then come from the rescue dir).
        self._rescue: Rescue | None = None
        # Asked for on every rank (the job's environment): the all-reduces that carry the
        # rescue's values have the same length everywhere, even on a rank that couldn't
        # start one (its values then turn it off for all).
        self._rescue_wanted = rescue
        self._rescue_rejected: set[int] = set()
        self._rescued_step: int | None = None
        if _dist_ready():
            dist = sys.modules["torch"].distributed
            self.rank, self.world_size = int(dist.get_rank()), int(dist.get_world_size())
            self.local_leader = self.rank == 0 if local_leader is None else local_leader
            self._group = self._make_group(barrier_timeout_s)
            # stop_requested()'s agreement runs at every step, while a save's collectives may
            # be running on _group in the background: a group of its own.
            self._stop_group = self._make_group(barrier_timeout_s)
            self._arrival = for_group(self._group, self.rank, self.world_size,
                                      arrival_timeout_s, _warn)
        elif world_size > 1:
            raise CheckpointError("checkpoint: world_size > 1 needs torch.distributed "
                                  "initialised before the CheckpointManager is created")
        if rescue:
            self._start_rescue()

    def _start_rescue(self) -> None:
        from slurm_resilience import heartbeat

        hb = heartbeat.current()
        if hb is None:
            print("checkpoint: rescue: off: this rank has no heartbeat (the rescue saves the "
                  "step of the last heartbeat.beat(step))", file=sys.stderr, flush=True)
            return
        self._rescue = Rescue(self, hb)
        self._rescue.start()

    # -- construction from the job's environment -------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointManager:
        """Job id, rank, staging dir (config) and run URI from the environment."""
        env = dict(os.environ if env is None else env)
        allow_fresh, allow_older = env_flag(env, ENV_ALLOW_FRESH), env_flag(env, ENV_ALLOW_OLDER)
        rescue = env_flag(env, ENV_RESCUE)
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

            node = node_name(cfg.node.name, env)
            jdir = job_dir(node_path(ck.staging_root, node), job_id)
            # Only a run with a URI has anything to stage in or upload.
            agent_socket = node_path(cfg.agent.socket, node) if uri else None
        else:
            raise CheckpointError(f"checkpoint: from_env: no SLURM_JOB_ID and no {ENV_DIR}; "
                                  "run under Slurm or name a local directory")
        if uri is not None:
            from slurm_resilience.checkpoint.prefix import check_run_uri

            check_run_uri(uri, ck.allowed_prefix, pwd.getpwuid(os.getuid()).pw_name)
        # -- RangeSource selection: the one place that decides how a restore gets its bytes.
        # A run with a URI and an agent asks the agent (ckpt.fetch) for just the ranges this
        # rank reads: stage-in brought only the step's metadata, the rest may be in S3.
        # A local-only run has every byte in this node's staging dir already.
        ranges: RangeSource = LocalRanges(jdir)
        if uri is not None and agent_socket is not None and job_id is not None:
            from slurm_resilience.checkpoint.agent_ranges import AgentRanges

            ranges = AgentRanges(agent_socket, job_id)
        mgr = cls(jdir, rank=rank, world_size=world, local_leader=local_rank == 0, uri=uri,
                  job_id=job_id, agent_socket=agent_socket,
                  stagein_timeout_s=ck.stagein_timeout_s, ranges=ranges,
                  allow_fresh_start=allow_fresh, allow_older_step=allow_older,
                  arrival_timeout_s=ck.save_arrival_timeout_s,
                  quota_fraction=ck.job_quota_fraction, rescue=rescue)
        if uri is not None and agent_socket is not None and job_id is not None:
            mgr._register(node_name(cfg.node.name, env), ck.agent_unreachable,
                          cfg.agent.request_timeout_s)
        interrupt.arm(mgr, env, cfg.agent.request_timeout_s)
        return mgr

    def _make_group(self, timeout_s: float) -> Any:
        import torch.distributed as dist

        # A group of our own, so the background save never interleaves with training
        # collectives on the default group.
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def group(self) -> Any:
        """The gloo group checkpoints use (pass it as ``process_group=`` to dcp calls)."""
        return self._group

    def _register(self, node: str, policy: str, timeout_s: float) -> None:
        """Once per job: one rank of each node registers the URI; every rank learns
        which agents can't be reached and raises or warns alike (agent_link.py)."""
        from slurm_resilience.checkpoint.agent_link import Registration, connect

        assert self.agent_socket is not None and self.job_id is not None and self.uri
        reg = Registration(self.agent_socket, self.job_id, self.uri, self.allow_older_step,
                           timeout_s)
        lost = connect(reg, node=node, rank=self.rank, group=self._group, policy=policy)
        if lost:  # this node's checkpoints stay here; load_latest says why it can't restore
            self.agent_socket = None
            self._agent_lost = lost

    def _all_max(self, values: list[int], group: Any = None) -> list[int]:
        """Element-wise max of ``values`` over all ranks (our own group, or ``group``)."""
        group = self._group if group is None else group
        if group is None:
            return values
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in t.tolist()]

    # -- stopping ahead of a time limit or at preemption (interrupt.py) --------------------

    def stop_requested(self, step: int, every: int = 1) -> interrupt.Stop | None:
        """Call at each step boundary: not None when the job was warned ahead of its time
        limit or preempted, the same answer on every rank (one small all-reduce, made only
        at steps that are a multiple of ``every``)."""
        return None if every > 1 and step % every else interrupt.agree(self)

    def stop(self, step: int, why: interrupt.Stop, state_dict: Mapping[str, Any] | None = None,
             *, model: Any = None, optimizer: Any = None, scheduler: Any = None) -> str:
        """Save ``step``, wait for its commit everywhere, and have the job requeued ahead of
        its time limit; then leave the training loop. Returns what happened, as printed."""
        return interrupt.stop(self, step, why, state_dict, model=model, optimizer=optimizer,
                              scheduler=scheduler)

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, state_dict: Mapping[str, Any] | None = None, *,
             model: Any = None, optimizer: Any = None, scheduler: Any = None) -> None:
        """Snapshot the state now; write and commit it through DCP in the background.

        ``model``/``optimizer``/``scheduler`` are saved as ``load_latest`` with the same
        arguments restores them (:func:`train_state`); ``state_dict`` adds entries (plain
        tensors and values, DTensor (FSDP2) state dicts, top-level Stateful objects). What
        can't be saved raises a CheckpointError naming the key, on every rank, before
        anything is written. A save that arrives while the previous one is still writing
        waits for it (its buffers are reused): the stall is then the rest of that write.
        """
        started = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - started
        step_name(step)  # rejects a negative step before any collective
        self._meet(step)
        problem: CheckpointError | None = None
        state: dict[Any, Any] = {}
        keys = SHARDED
        try:
            if not isinstance(state_dict, (Mapping, type(None))):
                raise CheckpointError(f"checkpoint: save: the state must be a mapping, not "
                                      f"{type(state_dict).__name__}")
            template = train_state(state_dict, model=model, optimizer=optimizer,
                                   scheduler=scheduler)
            state = resolve_stateful(template)
            check_state(state)
            if self._rescue is not None:
                self._rescue.remember(template)
                keys = keys_hash(state)
            if self.quota_fraction is not None:
                check_before_save(str(self.job_dir), self.job_id or 0, state,
                                  self.quota_fraction)
        except CheckpointError as exc:
            problem = exc
        # One decision for every rank: a node that already holds the step committed, or a
        # rank whose state can't be saved, stops the save everywhere.
        here = (self.job_dir / step_name(step) / COMMIT).exists()
        # With the rescue on, the same all-reduce compares the states' keys (rescue.py).
        committed, bad, *agreed = self._all_max([int(here), int(problem is not None)] + (
            [keys, -keys] if self._rescue_wanted else []))
        if self._rescue is not None and agreed:
            self._rescue.agree(*agreed)
        if bad:
            raise problem or CheckpointError(
                f"checkpoint: save: step {step}: another rank's state can't be saved (its "
                "error names the key); nothing was saved")
        if committed and step in self._trusted:
            print(f"checkpoint: save: step {step} is already committed (this run loaded or "
                  "saved it); not overwriting", file=sys.stderr)
            return
        if committed:
            self._set_aside_or_raise(step, here)
        snapshot = self._snap.take(state)
        from slurm_resilience.checkpoint.dcp_writer import StagingWriter

        writer = StagingWriter(self.job_dir, step)
        stall = time.perf_counter() - started
        self._thread = threading.Thread(target=self._persist,
                                        args=(step, snapshot, writer, stall),
                                        name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        self.last_stall_s = time.perf_counter() - started

    def _meet(self, step: int) -> None:
        if self._arrival is not None:  # before any collective: see arrival.py
            self._arrival.meet(f"save-{step}", f"save({step})")

    def prepare(self, state_dict: Mapping[str, Any] | None = None, *, model: Any = None,
                optimizer: Any = None, scheduler: Any = None) -> None:
        """Allocate the snapshot buffers now (the arguments as ``save()`` takes them), so the
        first ``save()`` stalls only for a copy, as later saves do. Optional; memory: the
        host copy of this rank's state ``save()`` keeps anyway. What can't be saved raises
        here, as in ``save()``; tensors added or reshaped later get buffers then."""
        self.wait()
        template = train_state(state_dict, model=model, optimizer=optimizer,
                               scheduler=scheduler)
        state = resolve_stateful(template)
        check_state(state)
        if self._rescue is not None:
            self._rescue.remember(template)
        self._snap.take(state)  # allocates and writes every page: none faults in a save
        from slurm_resilience.checkpoint import dcp_writer  # noqa: F401 - not in the stall

    def _set_aside_or_raise(self, step: int, here: bool) -> None:
        """A committed ``step`` that this run neither loaded nor saved: a save must neither
        skip (the new state would never be written) nor overwrite it. One this run's restore
        found corrupt is set aside, without an agent (with one, its stage-in already did
        that, and its uploads may be reading the dir); anything else raises, every rank."""
        if step not in self._passed_over or self.agent_socket is not None:
            raise CheckpointError(
                f"checkpoint: save: step {step} is already committed in {self.job_dir} "
                f"(on {'this node' if here else 'another node'}) but this run neither "
                "loaded nor saved it (an earlier run's step that this run did not resume "
                "from); not overwriting it, and not dropping this save: resume from it "
                "(load_latest) or save under another step number")
        if here and self.local_leader:
            aside = self.job_dir / f".passed-over-{step_name(step)}.{time.time_ns()}"
            os.rename(self.job_dir / step_name(step), aside)
            print(f"checkpoint: save: WARNING: step {step} is committed here but this run's "
                  f"restore passed over it ({self._passed_over[step]}); set aside as {aside}, "
                  "saving the new step in its place", file=sys.stderr, flush=True)
        self._all_max([0])  # a barrier: every node's copy is gone before anyone writes

    def _persist(self, step: int, snapshot: dict[str, Any], writer: Any, stall_s: float
                 ) -> None:
        from torch.distributed.checkpoint import state_dict_saver

        from slurm_resilience.checkpoint.structure import StructurePlanner

        started = time.perf_counter()
        try:
            # The planner keeps the state's shape, so that load_latest() returns it exactly.
            state_dict_saver.save(snapshot, storage_writer=writer, process_group=self._group,
                                  no_dist=self._group is None, planner=StructurePlanner())
            self._mark(step)
            if self.local_leader:
                self._report_save(step, stall_s, time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._error = exc
        finally:
            if not self.keep_buffers:
                self._snap.release()

    def _mark(self, step: int) -> None:
        """dcp.save returned on this rank, so every part is durable: mark this node."""
        if self.local_leader and not (self.job_dir / step_name(step) / COMMIT).exists():
            # The save id the coordinator decided, from this rank's own part (any other
            # part in the step dir could be left over from an abandoned save).
            save_id = read_manifest(part_dirs(self.job_dir, step, self.rank)[1]).save_id
            write_commit_marker(self.job_dir, step, self.world_size, save_id)
        if self.local_leader and self._rescue is not None:
            drop_upto(rescue_root(self.job_dir), step)  # a newer step is committed
        self.last_saved = step
        self._trusted.add(step)

    def _report_save(self, step: int, stall_s: float, write_s: float) -> None:
        """Tell the node agent this save's stall and write time (its metrics and goodput).
        From the background writer: the training loop never waits on the agent."""
        if self.agent_socket is None or self.job_id is None:
            return
        from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

        # The attempt (requeues and relaunches), as the heartbeat slots number the runs: a
        # relaunch's stalls are its own run's, not the first run's.
        run = attempt.from_env(os.environ)
        try:
            call(self.agent_socket, "metrics.ckpt_saved", timeout=5.0, job_id=self.job_id,
                 step=step, run=run, stall_s=round(stall_s, 6), write_s=round(write_s, 6))
        except (AgentRefused, AgentUnavailable) as exc:
            if not self._save_report_failed:  # once: the training goes on regardless
                print(f"checkpoint: WARNING: the node agent went away ({exc}): this node's "
                      f"checkpoints are not uploaded to {self.uri or 'S3'} until it returns"
                      if isinstance(exc, AgentUnavailable) else f"checkpoint: couldn't report "
                      f"step {step}'s save times to the node agent ({exc}); its metrics and "
                      "goodput miss them", file=sys.stderr, flush=True)
            self._save_report_failed = True

    def wait(self) -> None:
        """Block until the background save committed; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._future is not None:
            (fut, marked), self._future = self._future, None
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - reported below
                self._error = self._error or exc
            # A future's waiters wake before its callbacks run: wait for ours (the marker).
            marked.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint: save failed: {err}") from err

    def release_buffers(self) -> None:
        """Free the snapshot buffers (after the pending save); the next save allocates anew."""
        self.wait()
        self._snap.release()

    # -- DCP users: storage_writer / storage_reader ---------------------------------------

    def storage_writer(self, step: int) -> Any:
        """A DCP StorageWriter for ``step``: ``dcp.save(state, storage_writer=w,
        process_group=ckpt.group)`` or ``dcp.async_save(...)``, then ``ckpt.commit(step,
        future)``. As async_save's stager it reuses this manager's snapshot buffers, so
        the previous save is waited for first."""
        from slurm_resilience.checkpoint.dcp_writer import StagingWriter

        self.wait()
        self._meet(step)
        return StagingWriter(self.job_dir, step, snapshot=self._snap)

    def commit(self, step: int, future: Any = None) -> None:
        """After ``dcp.save`` with ``storage_writer(step)`` returned on this rank (or, given
        the future of ``dcp.async_save``, once it resolves): this node's local leader writes
        the step's COMMIT.json (rank 0's node has it from DCP's finish step already)."""
        if future is None:
            self._mark(step)
            return
        done = getattr(future, "upload_completion", future)  # AsyncSaveResponse or Future

        marked = threading.Event()

        def on_done(fut: Any) -> None:
            try:
                if fut.exception() is None:
                    self._mark(step)
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc
            finally:
                marked.set()

        self._future = (done, marked)
        done.add_done_callback(on_done)

    def storage_reader(self, step: int) -> Any:
        """A DCP StorageReader for committed ``step``, reading through this job's RangeSource."""
        from slurm_resilience.checkpoint.dcp_reader import StagingReader

        if step == self._rescued_step:  # every byte is on this node: rescue_restore.py
            return StagingReader(rescue_root(self.job_dir), step)
        return StagingReader(self.job_dir, step, self.ranges)

    # -- loading ---------------------------------------------------------------------------

    def wait_stagein(self) -> StageinStatus:
        """Wait until the agent finished staging this job's newest step in."""
        if self.agent_socket is None or self.job_id is None:
            return StageinStatus("none")
        return wait_stagein(self.agent_socket, self.job_id, self.stagein_timeout_s)

    def _fresh_or_raise(self, message: str) -> None:
        if not self.allow_fresh_start:
            raise CheckpointError(f"{message}; to start from scratch instead set "
                                  f"{ENV_ALLOW_FRESH}=1 (allow_fresh_start=True)")
        print(f"checkpoint: WARNING: {message}; STARTING FROM SCRATCH because "
              f"{ENV_ALLOW_FRESH} / allow_fresh_start is set", file=sys.stderr, flush=True)

    def latest_step(self, exclude: Mapping[int, str] | None = None) -> int | None:
        """The newest committed step, the same on every rank, ready to load; None only when
        the run has nothing committed (or allow_fresh_start turned a failure into a fresh
        start). Raises a CheckpointError naming the step and the cause otherwise
        (choose_step.py). ``exclude``: steps this restore found corrupt."""
        return choose.latest_step(self, exclude)

    def load_latest(self, state: dict[str, Any] | None = None, *, model: Any = None,
                    optimizer: Any = None, scheduler: Any = None) -> Loaded | None:
        """Load the newest committed step in place (any world size) into ``model``,
        ``optimizer``, ``scheduler`` (restored whole: :func:`train_state`) and ``state``.

        A ``state`` that can't take the step whole (a copy of an optimizer's state, no
        place for saved entries) raises a TemplateMismatch naming them, before anything
        loads. Returns a :class:`Loaded`, or None only when the run has no committed step
        anywhere; with nothing to load into, ``Loaded.state`` is a new dict of full CPU
        tensors and plain values, shaped exactly as saved. A committed step that can't be
        loaded (stage-in failed, files missing, ranks disagreeing on the step) raises a
        CheckpointError naming the step and the cause, unless ``allow_fresh_start``.
        A save at the fault newer than every committed step is loaded instead (rescue.py).
        """
        return loading.load_latest(self, state, model=model, optimizer=optimizer,
                                   scheduler=scheduler)

    def close(self) -> None:
        """Finish the pending save (call before exiting); a warning ahead of the time limit
        arriving from now on is ignored."""
        self.wait()
        interrupt.disarm()
        if self._rescue is not None:
            self._rescue.stop()  # the loop is over: nothing left to save at a fault


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _dist_ready() -> bool:
    if "torch" not in sys.modules:
        return False
    dist = sys.modules["torch"].distributed
    return bool(dist.is_available() and dist.is_initialized())


__all__ = ["ENV_ALLOW_FRESH", "ENV_ALLOW_OLDER", "CheckpointError", "CheckpointManager",
           "Fallen", "FileEntry", "Loaded", "StageinStatus", "part_dirs"]
