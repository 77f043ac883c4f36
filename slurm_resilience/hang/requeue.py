"""Requeue policy: requeue a hung job at most once per incident, up to a cap, then hold.

The job's hang history lives in its AdminComment as a short token,
``[sr-hang n=2 ckpt=15 restart=1]``, followed by our reason and ``|``
before any text of others: slurmctld keeps it across requeues and
whichever node becomes the batch host, and users cannot set AdminComment, so
they cannot reset their own count. ``restart`` is the job's Restarts value
when we acted: seeing the same value again means this run was already handled
(a second agent, or the same one on its next tick), so nothing is done twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_resilience.config.heartbeat import HeartbeatSection

_TOKEN = re.compile(r"\[sr-hang n=(\d+) ckpt=(-?\d+) restart=(\d+)\]")


@dataclass(frozen=True)
class Ledger:
    """Hang requeues so far, the checkpoint step at the last one, and the job's Restarts then."""

    requeues: int = 0
    ckpt_step: int = -1
    restart: int = -1

    def token(self) -> str:
        return f"[sr-hang n={self.requeues} ckpt={self.ckpt_step} restart={self.restart}]"


def parse_ledger(admin_comment: str) -> Ledger | None:
    m = _TOKEN.search(admin_comment)
    if not m:
        return None
    return Ledger(int(m.group(1)), int(m.group(2)), int(m.group(3)))


def merge_comment(admin_comment: str, ledger: Ledger, text: str = "") -> str:
    """The AdminComment with our token replaced (others' text kept) and ``text`` after it."""
    rest = _TOKEN.sub("", admin_comment)
    rest = re.sub(r"^\s*SR:\s*", "", rest)
    rest = re.sub(r"\bhang job \d+:[^|]*(\||$)", "", rest).strip(" |")
    ours = f"{ledger.token()} {text}".strip()
    return f"{ours} | {rest}" if rest else ours


@dataclass(frozen=True)
class Decision:
    """What to do about one hang of a job."""

    action: str  # requeue | hold | report | skip
    reason: str
    ledger: Ledger


def decide(job_id: int, *, restarts: int, admin_comment: str, ckpt_step: int, mode: str,
           cfg: HeartbeatSection) -> Decision:
    """Pure decision for a hang of run ``restarts`` of ``job_id`` seen now."""
    previous = parse_ledger(admin_comment) or Ledger()
    if previous.restart == restarts:
        return Decision("skip", f"hang job {job_id}: run {restarts} was already handled",
                        previous)
    if mode != "act":
        return Decision("report", f"hang job {job_id}: mode {mode}: reported, no action",
                        previous)
    nxt = Ledger(previous.requeues + 1, ckpt_step, restarts)
    if previous.requeues >= cfg.max_requeues:
        return Decision("hold", f"hang job {job_id}: held after {previous.requeues} hang "
                                f"requeues (cap {cfg.max_requeues})",
                        Ledger(previous.requeues, ckpt_step, restarts))
    if (cfg.require_checkpoint_progress and previous.requeues > 0
            and ckpt_step <= previous.ckpt_step and previous.ckpt_step >= 0):
        return Decision("hold", f"hang job {job_id}: held, checkpoint did not advance since "
                                f"the last hang requeue (step {ckpt_step}, was "
                                f"{previous.ckpt_step})",
                        Ledger(previous.requeues, ckpt_step, restarts))
    return Decision("requeue", f"hang job {job_id}: requeue {nxt.requeues} of "
                               f"{cfg.max_requeues}", nxt)
