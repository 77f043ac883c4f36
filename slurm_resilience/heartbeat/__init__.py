"""Training-side hang detection: tell the node agent that the training loop progresses.

Usage in a training loop::

    from slurm_resilience import heartbeat

    for step in range(start, steps):
        train_step()
        heartbeat.beat(step)            # once per iteration: about a microsecond
        if step % every == 0:
            with heartbeat.section("checkpoint"):   # its own, longer timeout
                save(step)
            heartbeat.checkpointed(step)
    heartbeat.done()

Outside a Slurm job managed by slurm-resilience every call is a no-op, so the
same script runs on a laptop. Per-job options, read from the environment:

* ``SLURM_RESILIENCE_HANG_TIMEOUT``: step timeout in seconds for this job
  (bounded by the cluster's limits, which stay below the NCCL timeout);
* ``SLURM_RESILIENCE_HANG=observe`` (report only) or ``off`` (do not watch).

Recovery needs the job to be requeueable and to resume on its own. Submit with
``sbatch --requeue --open-mode=append``: ``--requeue`` lets the agent put the job
back in the queue (it restarts from the top of the script with the same job id and
``SLURM_RESTART_COUNT`` one higher) and ``--open-mode=append`` keeps the output of
earlier runs in the same file. At start, call ``CheckpointManager.from_env()``
and ``load_latest(state)``: it loads the newest step whose every rank's part is
committed, so the run continues from there; call ``checkpointed(step)`` with it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

from slurm_resilience.heartbeat import attempt
from slurm_resilience.heartbeat import slot as S
from slurm_resilience.heartbeat.writer import Heartbeat

__all__ = ["Heartbeat", "beat", "checkpointed", "current", "done", "init", "section",
           "stopped", "stopping"]

ENV_TIMEOUT = "SLURM_RESILIENCE_HANG_TIMEOUT"
ENV_MODE = "SLURM_RESILIENCE_HANG"

_current: Heartbeat | None = None
_disabled = False


def _int(env: Mapping[str, str], *names: str, default: int = 0) -> int:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return default


def _job_dir(env: Mapping[str, str], job_id: int) -> str:
    from slurm_resilience.heartbeat.paths import ENV_RUN_DIR, job_dir

    if env.get(ENV_RUN_DIR):
        return os.path.join(env[ENV_RUN_DIR], f"job-{job_id}")
    from slurm_resilience import config
    from slurm_resilience.config.paths import node_name

    cfg = config.load(config.job_config_path(env))
    return job_dir(cfg.node.run_dir, node_name(cfg.node.name, env), job_id)


def init(env: Mapping[str, str] | None = None) -> Heartbeat | None:
    """Create this rank's slot from the Slurm/torchrun environment; None when not managed."""
    global _current, _disabled
    env = os.environ if env is None else env
    job_id = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    mode = env.get(ENV_MODE, "").strip().lower()
    if not job_id or mode == "off":
        _disabled = True
        return None
    if mode not in ("", "act", "observe"):
        raise ValueError(f"heartbeat: {ENV_MODE}={mode!r}: use act, observe or off")
    raw_timeout = env.get(ENV_TIMEOUT, "").strip()
    try:
        timeout = float(raw_timeout) if raw_timeout else 0.0
    except ValueError:
        raise ValueError(f"heartbeat: {ENV_TIMEOUT}={raw_timeout!r} is not a number of "
                         "seconds") from None
    from slurm_resilience.config import ConfigError

    try:
        directory = _job_dir(env, job_id)
    except (OSError, ValueError, ConfigError) as exc:
        # An unreadable cluster config must not stop training: it only loses hang detection.
        print(f"slurm-resilience: heartbeat: couldn't find the run directory: {exc}; hang "
              "detection is off for this rank", file=sys.stderr)
        _disabled = True
        return None
    if not os.path.isdir(directory):
        print(f"slurm-resilience: heartbeat: no run directory {directory}; hang detection is "
              "off for this rank (is the prolog installed?)", file=sys.stderr)
        _disabled = True
        return None
    rank = _int(env, "RANK", "SLURM_PROCID")
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1)
    try:
        _current = Heartbeat(
            os.path.join(directory, S.slot_filename(rank)), rank=rank,
            world_size=max(world, 1), local_rank=_int(env, "LOCAL_RANK", "SLURM_LOCALID"),
            job_id=job_id, restart_count=attempt.from_env(env),
            step_timeout_s=timeout, flags=S.FLAG_OBSERVE if mode == "observe" else 0,
        )
    except OSError as exc:
        # EACCES: the job does not see its run-dir tmpfs (a private mount namespace made
        # before the prolog, e.g. job_container/tmpfs; see the heartbeat README). Training
        # goes on; only hang detection is lost, and the job's stderr says so.
        print(f"slurm-resilience: heartbeat: couldn't create this rank's slot in "
              f"{directory}: {exc.strerror}; hang detection is off for this rank",
              file=sys.stderr)
        _disabled = True
        return None
    atexit.register(_done_at_exit, _current)
    return _current


def _done_at_exit(hb: Heartbeat) -> None:
    """A rank that exits without calling done() is done, unless it is ending on an uncaught
    exception (a peer's death raising in a collective, say): Python has printed it and set
    ``sys.last_value`` by now. That rank crashed; said done, goodput would count its run as
    one that ended well."""
    if getattr(sys, "last_value", None) is None:
        hb.done()


def current() -> Heartbeat | None:
    """This rank's heartbeat, created on first use; None outside a managed job."""
    if _current is None and not _disabled:
        init()
    return _current


def beat(step: int) -> None:
    """Record that training step ``step`` finished. Call once per iteration."""
    hb = _current
    if hb is not None:
        hb.beat(step)
    elif not _disabled:
        hb = current()
        if hb is not None:
            hb.beat(step)


@contextlib.contextmanager
def section(name: str, timeout_s: float | None = None) -> Iterator[None]:
    """Mark a long phase such as ``checkpoint`` or ``eval``; it has its own timeout."""
    hb = current()
    if hb is None:
        S.clean_section_name(name)
        yield
        return
    with hb.section(name, timeout_s):
        yield


def checkpointed(step: int) -> None:
    """Record the newest checkpointed (or resumed-from) step."""
    hb = current()
    if hb is not None:
        hb.checkpointed(step)


def done() -> None:
    """The training loop is over: silence from this rank is no longer a hang."""
    hb = current()
    if hb is not None:
        hb.done()


def stopping() -> None:
    """The loop saves to stop ahead of a time limit or at preemption: set before the save,
    so the agent sees it however soon the job is gone."""
    hb = current()
    if hb is not None:
        hb.stopping()


def stopped() -> None:
    """The loop saved and stopped ahead of a time limit or at preemption (a planned
    restart follows): done, and counted apart in goodput."""
    hb = current()
    if hb is not None:
        hb.stopped()
