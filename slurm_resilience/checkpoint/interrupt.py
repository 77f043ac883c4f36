"""Save the newest step and stop when the job is warned ahead of its time limit or
preempted; the run goes on in the requeued job.

Two signals reach a rank:

* the warning, sent by the node agent ``checkpoint.limit_lead_s`` before the job's time
  limit to the ranks that armed it (``SIGUSR1``; ``SLURM_RESILIENCE_LIMIT_SIGNAL`` picks
  ``USR2`` or ``URG``; see :mod:`slurm_resilience.hang.limits` for why not Slurm's
  ``--signal``);
* ``SIGTERM``, which Slurm sends at preemption (``PreemptMode=REQUEUE`` or ``CANCEL``, with a
  ``GraceTime``) and at the limit itself.

The handlers only record which signal came and when: no work in a signal handler, and
Python runs them in the main thread alone, so no NCCL or save thread ever sees one. A
handler is installed only where the process has none of its own (a job with its own
``--signal`` handling keeps it, and is not armed). ``SLURM_RESILIENCE_LIMIT_WARN=off``
asks for no warning.

At each step boundary :meth:`CheckpointManager.stop_requested` folds every rank's flag into
one answer (an all-reduce of one integer on the checkpoint group), so all ranks stop at
the same step. :meth:`CheckpointManager.stop` then saves that step, waits for its local
commit on every node, and has rank 0 tell its agent: ahead of a time limit the agent
requeues the job (root, ``scontrol requeue``: a job ended by its limit is TIMEOUT, which
``--requeue`` does not restart); at preemption Slurm itself requeues or ends it. The
upload to S3 goes on after the job is gone, and the requeued job's stage-in waits for it
through the intent records, as after any requeue.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurm_resilience.checkpoint.manager import CheckpointManager

ENV_WARN = "SLURM_RESILIENCE_LIMIT_WARN"
ENV_SIGNAL = "SLURM_RESILIENCE_LIMIT_SIGNAL"
SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "URG": signal.SIGURG}
NONE, TIME_LIMIT, PREEMPT = 0, 1, 2
CAUSES = {TIME_LIMIT: "time_limit", PREEMPT: "preempt"}

# Written by the handlers (a list item store: nothing else happens in a handler).
_got = [NONE]
_at = [0.0]
_lead = [0.0]  # the agent's lead time, when armed
_warn_signal = [0]


@dataclass(frozen=True)
class Stop:
    """Why the run stops at this step, the same on every rank."""

    cause: str  # time_limit | preempt
    seconds_left: float | None  # until the time limit, as this rank reckons it


def _on_signal(signum: int, frame: FrameType | None) -> None:
    code = PREEMPT if signum == signal.SIGTERM else TIME_LIMIT
    if code > _got[0]:
        _got[0] = code
        _at[0] = time.time()


def _install(signum: int) -> bool:
    """Our flag-only handler for ``signum``, unless the process handles it itself."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signum) not in (signal.SIG_DFL, _on_signal):
        return False
    signal.signal(signum, _on_signal)
    return True


def arm(mgr: CheckpointManager, env: Mapping[str, str], timeout_s: float) -> None:
    """At the manager's start: catch SIGTERM, and ask the node agent for the warning ahead
    of the time limit (a run with a URI and an agent only). Says on stderr why a rank
    goes without it, never fails the job."""
    _install(signal.SIGTERM)
    if env.get(ENV_WARN, "").strip().lower() in ("off", "0", "no", "false"):
        return
    if mgr.agent_socket is None or mgr.job_id is None:
        return
    name = env.get(ENV_SIGNAL, "USR1").strip().upper().removeprefix("SIG") or "USR1"
    if name not in SIGNALS:
        print(f"slurm-resilience: {ENV_SIGNAL}={name}: one of {', '.join(SIGNALS)}; no "
              "warning ahead of the time limit", file=sys.stderr, flush=True)
        return
    if not _install(SIGNALS[name]):
        if mgr.rank == 0:
            print(f"slurm-resilience: SIG{name} is handled by the job itself; no warning "
                  "ahead of the time limit from the node agent", file=sys.stderr, flush=True)
        return
    from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call

    try:
        answer = call(mgr.agent_socket, "limits.arm", timeout=timeout_s, job_id=mgr.job_id,
                      signal=name)
    except (AgentUnavailable, AgentRefused) as exc:
        print(f"slurm-resilience: no warning ahead of the time limit: {exc}",
              file=sys.stderr, flush=True)
        return
    lead = answer.get("lead_s")
    _lead[0] = float(lead) if isinstance(lead, (int, float)) else 0.0
    _warn_signal[0] = SIGNALS[name]
    # Python puts its default action back while the interpreter shuts down, and a warning
    # arriving then would end a process that finished well: ignored from exit on.
    atexit.register(disarm)


def disarm() -> None:
    """The loop is over (``close()``, exit): a warning from now on is ignored."""
    signum = _warn_signal[0]
    if signum and threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_IGN)


def requested() -> int:
    """This rank's flag: NONE, TIME_LIMIT or PREEMPT."""
    return _got[0]


def agree(mgr: CheckpointManager) -> Stop | None:
    """Every rank's flag folded into one answer (one small all-reduce); None: go on. The
    time left is reckoned from the latest warning any rank got (the nodes' agents send
    theirs on their own ticks)."""
    deadline = int(_at[0] + _lead[0]) if _got[0] == TIME_LIMIT and _lead[0] else 0
    code, latest = mgr._all_max([_got[0], deadline], mgr._stop_group)
    if code == NONE:
        return None
    return Stop(CAUSES[code], latest - time.time() if latest else None)


def stop(mgr: CheckpointManager, step: int, why: Stop, state: Mapping[str, Any] | None,
         **parts: Any) -> str:
    """Save ``step`` (unless this run saved it already), wait for its commit on every node,
    then rank 0 tells the agent, which requeues the job ahead of a time limit. Returns the
    line rank 0 printed on stderr (other ranks: the same text without the agent's answer)."""
    from slurm_resilience import heartbeat

    heartbeat.stopping()
    if step not in mgr._trusted:
        with heartbeat.section("checkpoint"):
            mgr.save(step, state, **parts)
            mgr.wait()
    else:
        mgr.wait()
    heartbeat.checkpointed(step)
    mgr._all_max([0])  # every node's commit is written: the step can be resumed from
    heartbeat.stopped()  # silence from here on is the stop, not a hang
    text = stop_text(why.cause, step, why.seconds_left, False)
    if mgr.rank != 0:
        return text
    if mgr.agent_socket is None or mgr.job_id is None:
        text += ("; not requeued: no node agent for this run (resubmit with the same URI "
                 "to resume)" if why.cause == "time_limit" else "")
    else:
        from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call
        from slurm_resilience.heartbeat import attempt

        try:
            answer = call(mgr.agent_socket, "limits.stopped", timeout=30.0, job_id=mgr.job_id,
                          step=step, cause=why.cause, requeue=why.cause == "time_limit",
                          seconds_left=why.seconds_left, run=attempt.from_env(os.environ))
            text = str(answer.get("text", text))
            if answer.get("why"):
                text += f"; not requeued: {answer['why']}"
        except (AgentUnavailable, AgentRefused) as exc:
            text += f"; not requeued: {exc}"
    print(f"slurm-resilience: {text}", file=sys.stderr, flush=True)
    return text


def stop_text(cause: str, step: int, seconds_left: float | None, requeued: bool, *,
              reached: bool = False) -> str:
    """``time limit in 120 s: saved step 4,812, requeued``; ``reached``: the save came
    after Slurm's SIGTERM at the limit itself (``time limit reached: ...``)."""
    what = "time limit" if cause == "time_limit" else "preempted"
    if cause == "time_limit" and reached:
        what += " reached"
    elif cause == "time_limit" and seconds_left is not None:
        what += f" in {max(0, round(seconds_left))} s"
    return f"{what}: saved step {step:,}" + (", requeued" if requeued else "")


def reset() -> None:
    """Forget a received signal (tests, and a process that trains again after a stop)."""
    _got[0], _at[0] = NONE, 0.0


__all__ = ["ENV_SIGNAL", "ENV_WARN", "Stop", "agree", "arm", "disarm", "requested", "reset",
           "stop", "stop_text"]
