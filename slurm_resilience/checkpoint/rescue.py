"""A save at the fault: the last finished step of a replicated state, from one rank alone.

At a hang, an Xid or a lost node, the ranks that survive hold the state of the last step
they finished, in memory, and lose on average half a checkpoint interval of work when the
job resumes from its last save. With data parallelism (DDP) every rank holds the whole
state, so any one of them can save it without a collective: this module does that, and a
relaunch inside the allocation resumes from it (``rescue_restore.py``).

When a rescue is written, by each node's local leader:

* its loop falls silent (no ``heartbeat.beat`` for ``silence_after``: five step times,
  at least 2 s, at most half the job's own step timeout) outside a heartbeat section:
  its main thread is blocked in a collective with a dead or hung peer. A thread of ours
  writes, while the main thread stays blocked;
* the training raises out of the script (a peer's death ends a collective with an error):
  Python's ``sys.excepthook``, before the process exits.

What is written is exactly the last step the loop finished, or nothing:

* the state is the one ``save()``/``prepare()``/``load_latest()`` were given, read live;
* the step is the last ``beat(step)``, which must have come right after the optimizer's
  last step (hooks on the optimizer tell: not inside a step, no step past the beat, no
  beats of micro-batches since), and no beat or optimizer step may come while the rescue
  writes: else nothing is kept;
* the state is in host memory: a GPU's work is queued ahead by the host, so after a
  collective that never ends the last beat does not name the step the device holds
  (saving GPU state at the fault needs CUDA events on the optimizer's steps: not built);
* every rank's state has the same keys and none is sharded (a DTensor: FSDP2), agreed at
  each ``save()`` and restore: one rank's copy is then what a collective save keeps.

A rescue goes to ``<job dir>/.rescue/step-N/`` (a DCP checkpoint of world size 1, with
manifests and a commit marker like any step), written aside and renamed into place. It is
never uploaded: it serves the relaunches of this allocation, and goes once a newer step
commits. Each rescue, and each one refused, is said on stderr and in the log.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from slurm_resilience.checkpoint.commit import (
    CheckpointError,
    committed_steps,
    fsync_dir,
    read_marker,
    saved_in_this_run,
    step_name,
)
from slurm_resilience.checkpoint.dcp_state import is_dtensor
from slurm_resilience.heartbeat.writer import Heartbeat, Progress
from slurm_resilience.log import get_logger

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager

log = get_logger("checkpoint.rescue")

ENV_RESCUE = "SLURM_RESILIENCE_CKPT_RESCUE"
RESCUE_DIR = ".rescue"
MIN_SILENCE_S = 2.0
SILENCE_STEPS = 5  # step times of silence before a rescue
POLL_S = 0.25
SHARDED = -1  # the key agreement's value for a state with a DTensor: never rescued


def silence_after(p: Progress) -> float:
    """How long a loop may be silent before its state is rescued."""
    after = max(MIN_SILENCE_S, SILENCE_STEPS * p.step_s)
    if p.step_timeout_s > 0:
        after = min(after, p.step_timeout_s / 2)
    return after


def due(p: Progress, now: float, rescued_beats: int) -> bool:
    """A silent loop, not yet rescued at this beat: a pure check for the watcher thread."""
    return (p.beats >= 2 and not p.in_section and not p.over and p.beats != rescued_beats
            and now - p.last >= silence_after(p))


def _leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    """Every leaf of a state with its path (keys typed: 0 and "0" differ)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{prefix}/{type(k).__name__}:{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{prefix}/{i}", v)
    else:
        yield prefix, value


def keys_hash(state: Mapping[Any, Any]) -> int:
    """One number for the keys of a resolved state (SHARDED when it holds a DTensor):
    ranks with equal numbers save the same entries."""
    leaves = list(_leaves("", state))
    if any(is_dtensor(v) for _, v in leaves):
        return SHARDED
    paths = sorted(path for path, _ in leaves)
    return zlib.crc32("\n".join(paths).encode()) + 1  # 1..2**32: never SHARDED or 0


class OptimizerWatch:
    """Whether an optimizer is inside a step, and at which beat its last step ended."""

    def __init__(self, beats: Any) -> None:
        self._beats = beats  # () -> the loop's beat count
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        self.watched = False
        self.inside = 0
        self.stepped_at = -1  # the beat count when the last step ended

    def watch(self, optimizer: Any) -> None:
        if id(optimizer) in self._seen or not hasattr(optimizer, "register_step_pre_hook"):
            return
        self._seen.add(id(optimizer))
        self.watched = True
        self._handles.append(optimizer.register_step_pre_hook(self._pre))
        self._handles.append(optimizer.register_step_post_hook(self._post))

    def _pre(self, *_: Any) -> None:
        self.inside += 1

    def _post(self, *_: Any) -> None:
        self.inside -= 1
        self.stepped_at = self._beats()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@dataclass(frozen=True)
class Rescued:
    step: int
    path: Path
    seconds: float


def rescue_root(job_dir: Path) -> Path:
    return job_dir / RESCUE_DIR


def rescued_steps(root: Path) -> list[int]:
    """Steps rescued on this node (a commit marker in place), oldest first."""
    return committed_steps(root)


def newest_of_this_run(root: Path, rejected: set[int]) -> int:
    """The newest step rescued here by this job's current run (-1: none)."""
    for step in reversed(rescued_steps(root)):
        if step in rejected:
            continue
        try:
            marker = read_marker(root / step_name(step))
        except (CheckpointError, OSError):
            continue
        if marker.step == step and saved_in_this_run(marker.save_id):
            return step
    return -1


def drop_upto(root: Path, step: int) -> None:
    """A step up to ``step`` committed: older rescues can never be needed again."""
    for old in rescued_steps(root):
        if old <= step:
            shutil.rmtree(root / step_name(old), ignore_errors=True)


class Rescue:
    """One rank's rescue: a watcher thread, the excepthook, and the write itself."""

    def __init__(self, mgr: CheckpointManager, hb: Heartbeat) -> None:
        self.mgr = mgr
        self.hb = hb
        self.root = rescue_root(mgr.job_dir)
        self.opt = OptimizerWatch(lambda: self.hb.progress().beats)
        self._template: dict[str, Any] | None = None
        self.agreed = 0  # keys_hash every rank agreed on (0: not agreed, SHARDED: never)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rescued_beats = -1
        self._said: set[str] = set()
        self._thread: threading.Thread | None = None
        self._prev_hook: Any = None
        self.last: Rescued | None = None

    # -- the state and the agreement ----------------------------------------------------------

    def remember(self, template: Mapping[str, Any]) -> None:
        """The state as save()/prepare()/load_latest() got it (Stateful objects: read live)."""
        self._template = dict(template)
        for value in template.values():
            optimizer = getattr(value, "optimizer", None)
            if optimizer is not None:
                self.opt.watch(optimizer)

    def agree(self, hi: int, neg_lo: int) -> None:
        """The max of every rank's keys_hash, and of its negation (one all-reduce)."""
        self.agreed = hi if hi == -neg_lo and hi != SHARDED else SHARDED
        if self.agreed == SHARDED and self.mgr.rank == 0:
            self._say_once("sharded", "checkpoint: rescue: off for this state: it is sharded "
                           "(a DTensor: FSDP2) or its keys differ between ranks, so no rank "
                           "holds all of it")

    # -- triggers ------------------------------------------------------------------------------

    def start(self) -> None:
        if not self.mgr.local_leader:
            return
        self._thread = threading.Thread(target=self._watch, name="ckpt-rescue", daemon=True)
        self._thread.start()
        if threading.current_thread() is threading.main_thread():
            self._prev_hook = sys.excepthook
            sys.excepthook = self._excepthook

    def stop(self) -> None:
        self._stop.set()
        self.opt.close()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook or sys.__excepthook__

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            p = self.hb.progress()
            if due(p, time.monotonic(), self._rescued_beats):
                self.now(f"no beat for {time.monotonic() - p.last:.1f}s after step {p.step}")

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            self.now(f"the training raised {kind.__name__}: {str(exc)[:200]}")
        (self._prev_hook or sys.__excepthook__)(kind, exc, tb)

    # -- the rescue ----------------------------------------------------------------------------

    def refusal(self, p: Progress) -> str:
        """Why the state can't be saved as step ``p.step`` now ("": it can)."""
        if self._template is None:
            return "no state yet (save(), prepare() or load_latest() names it)"
        if p.beats < 1:
            return "no step finished in this run yet"
        if self.agreed == 0:
            return "the ranks have not compared their states' keys yet (at a save or restore)"
        if self.agreed == SHARDED:
            return "the state is sharded or differs between ranks"
        newest = max(self.mgr.last_saved if self.mgr.last_saved is not None else -1,
                     self.last.step if self.last is not None else -1)
        if p.step <= newest:
            return f"step {p.step} is saved already"
        if self.opt.inside:
            return "the optimizer is inside a step"
        if self.opt.watched and self.opt.stepped_at != p.beats - 1:
            # The state is the last beat's only when that beat closed the optimizer's last
            # step: after it (stepped past the beat), or beats in between (micro-batches of
            # an accumulation), the step the state holds has no beat of its own.
            return (f"the last beat (step {p.step}) did not come right after the optimizer's "
                    "last step; beat(step) once per optimizer step, after it")
        return ""

    def now(self, why: str) -> Rescued | None:
        """Write the rescue, or say why not (stderr, log); never raises."""
        with self._lock:
            p = self.hb.progress()
            if p.beats == self._rescued_beats:
                return self.last
            self._rescued_beats = p.beats
            refused = self.refusal(p)
            if refused:
                if not refused.startswith("step "):
                    self._say_once(refused, f"checkpoint: rescue: not saving at the fault "
                                   f"({why}): {refused}")
                log.info("rescue refused", step=p.step, why=why, refused=refused)
                return None
            started = time.monotonic()
            try:
                done = self._write(p, started)
            except Exception as exc:  # noqa: BLE001 - a rescue must never take the job down
                print(f"checkpoint: rescue: couldn't save step {p.step} at the fault ({why}): "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                log.warning("rescue failed", step=p.step, why=why, error=str(exc))
                return None
            if isinstance(done, str):
                print(f"checkpoint: rescue: step {p.step} not saved at the fault ({why}): "
                      f"{done}", file=sys.stderr, flush=True)
                log.warning("rescue not saved", step=p.step, why=why, cause=done)
                return None
            self.last = done
            self.hb.checkpointed(done.step)
            print(f"checkpoint: rescue: saved step {done.step} at the fault ({why}) in "
                  f"{done.seconds:.2f}s: {done.path}; a relaunch resumes from it",
                  file=sys.stderr, flush=True)
            log.warning("rescued the last finished step", step=done.step, why=why,
                        seconds=round(done.seconds, 3), path=str(done.path))
            return done

    def _write(self, p: Progress, started: float) -> Rescued | str:
        from torch.distributed.checkpoint import state_dict_saver

        from slurm_resilience.checkpoint.dcp_state import check_state, resolve_stateful
        from slurm_resilience.checkpoint.dcp_writer import StagingWriter
        from slurm_resilience.checkpoint.quota import check_before_save
        from slurm_resilience.checkpoint.structure import StructurePlanner

        assert self._template is not None
        state = resolve_stateful(self._template)
        if keys_hash(state) != self.agreed:
            return "its keys are not the ones every rank agreed on at the last save"
        device = _device_of(state)
        if device:
            # The host queues a GPU's work ahead of it: after a collective that never ends,
            # the loop may have beaten steps the device never ran, so the last beat does
            # not name the step the device's memory holds.
            return (f"the state is on {device}: the last beat does not tell which step the "
                    "device holds (only host-memory states are saved at the fault)")
        check_state(state, "rescue")
        if self.mgr.quota_fraction is not None:
            check_before_save(str(self.mgr.job_dir), self.mgr.job_id or 0, state,
                              self.mgr.quota_fraction)
        self.root.mkdir(mode=0o700, exist_ok=True)
        incoming = self.root / f".incoming-{os.getpid()}"
        shutil.rmtree(incoming, ignore_errors=True)
        incoming.mkdir(mode=0o700)
        try:
            state_dict_saver.save(state, storage_writer=StagingWriter(incoming, p.step),
                                  no_dist=True, planner=StructurePlanner())
            after = self.hb.progress()
            if after.beats != p.beats or self.opt.inside or \
                    (self.opt.stepped_at != p.beats - 1 and self.opt.watched):
                return "the loop moved on while it was written"
            final = self.root / step_name(p.step)
            if final.exists():
                shutil.rmtree(final)  # an earlier rescue of the same step: this one is newer
            os.rename(incoming / step_name(p.step), final)
            fsync_dir(self.root)
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        drop_upto(self.root, p.step - 1)  # one rescue kept: the newest
        return Rescued(p.step, final, time.monotonic() - started)

    def _say_once(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            print(text, file=sys.stderr, flush=True)


def _device_of(state: Any) -> str:
    """The first non-CPU device a tensor of ``state`` is on ("" when all are in host memory)."""
    for _, v in _leaves("", state):
        device = getattr(v, "device", None)
        if getattr(device, "type", "cpu") != "cpu":
            return str(device)
    return ""


__all__ = ["ENV_RESCUE", "RESCUE_DIR", "OptimizerWatch", "Rescue", "Rescued", "drop_upto",
           "due", "keys_hash", "newest_of_this_run", "rescue_root", "rescued_steps",
           "silence_after"]
