"""One hang incident, start to end: capture this node's piece, read the job from Slurm,
exchange pieces, blame, decide (pure), claim, act (retried until the deadline), report.

Every Slurm call is retried with backoff while Slurm fails, until the incident's deadline
(``heartbeat.incident_deadline_s``); the claimed plan and its progress are persisted, so an
agent restarted mid-incident resumes it instead of acting twice or forgetting it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from slurm_resilience import events
from slurm_resilience.config import Config
from slurm_resilience.hang import blame as B
from slurm_resilience.hang import ckptfacts, incident, localpiece, policy
from slurm_resilience.hang import relaunch as RL
from slurm_resilience.hang.actions import (
    Clocked,
    DeadlinePassed,
    Step,
    StepKind,
    Stopping,
    execute,
    retry,
    run_step,
)
from slurm_resilience.hang.incidentrecords import (
    Action,
    BlameDoc,
    Clock,
    Decision,
    DecisionDoc,
    Piece,
    PieceError,
    Report,
    Timings,
    first_hang,
    piece_from_bytes,
    piece_to_bytes,
)
from slurm_resilience.hang.launches import Launches
from slurm_resilience.hang.rendezvous import Rendezvous
from slurm_resilience.hang.store import ClaimBasis, IncidentStore, Progress, ProgressState
from slurm_resilience.heartbeat.attempt import RELAUNCH_STRIDE, relaunch_of, restarts_of
from slurm_resilience.log import get_logger
from slurm_resilience.slurm.adapter import SlurmAdapter
from slurm_resilience.slurm.errors import JobNotFound
from slurm_resilience.slurm.parse import JobInfo

log = get_logger("heartbeat")


def _blame_json(blamed: B.Blame, missing: Sequence[str]) -> BlameDoc:
    explanation = blamed.explanation
    if missing:
        explanation += f" (no observations from {', '.join(missing)})"
    return {"nodes": [n for n, _ in blamed.drains], "ranks": list(blamed.ranks),
            "rule": blamed.rule, "explanation": explanation}


def combine(own: Piece, others: Mapping[str, bytes]) -> dict[str, Piece]:
    """This node's piece and the valid ones of other nodes (invalid ones logged, left out)."""
    pieces = {own.node: own}
    for node, raw in others.items():
        try:
            pieces[node] = piece_from_bytes(raw, node)
        except PieceError as exc:
            log.warning("heartbeat: gather: refused a piece", node=node, error=str(exc))
    return pieces


class IncidentRunner:
    def __init__(self, cfg: Callable[[], Config], node: str, adapter: SlurmAdapter,
                 rendezvous: Rendezvous, store: IncidentStore, clock: Clock,
                 sleep: Callable[[float], object], incident_dir: str,
                 stopping: Callable[[], bool] = lambda: False,
                 launches: Launches | None = None):
        self.cfg = cfg
        self.node = node
        self.adapter = adapter
        self.rdv = rendezvous
        self.store = store
        self.clock = clock
        self.clocked = Clocked(clock, sleep, stopping)
        self.incident_dir = incident_dir
        self.launches = launches  # the launchers on this node (slurm-resilience launch)

    def _report(self, view: localpiece.JobView, piece: Piece, run: int, trigger: str,
                timings: Timings, **kw: Any) -> Report:
        rec = view.record
        base = Report(rec.job_id, run, rec.user, rec.uid, self.node, view.verdict.mode, trigger,
                      piece.ranks, {self.node: piece.evidence}, None, None, (), timings)
        return replace(base, **kw)

    def run(self, view: localpiece.JobView, trigger: str, run_hint: int | None) -> Report | None:
        """Handle one hang; ``run_hint`` is the run another node's piece was made in (None
        when this node's own ranks timed out). None when the agent stopped meanwhile: what was
        claimed is persisted and the next start resumes it (or detects the hang again)."""
        try:
            return self._run(view, trigger, run_hint)
        except Stopping as exc:
            log.warning("heartbeat: incident: left for the agent's next start",
                        job_id=view.record.job_id, why=str(exc))
            return None

    def _run(self, view: localpiece.JobView, trigger: str, run_hint: int | None) -> Report:
        cfg = self.cfg()
        hb = cfg.heartbeat
        rec = view.record
        detected = self.clock.time()
        log.warning("hang detected", job_id=rec.job_id, trigger=trigger,
                    ranks=[r.rank for r in view.verdict.hung], mode=view.verdict.mode)
        piece = localpiece.capture(cfg, self.node, view, trigger, self.incident_dir, detected)
        timings = Timings(detected, self.clock.time() - detected, first_hang(piece.ranks))
        run = max((v.restart_count for v in view.slots), default=0)
        deadline = detected + hb.incident_deadline_s
        try:
            job: JobInfo = retry("read the job", lambda: self.adapter.show_job(rec.job_id),
                                 deadline, self.clocked)
        except (DeadlinePassed, JobNotFound) as exc:
            if not rec.nodes or rec.nodes[0] == self.node:  # one node counts it
                self._count(Action.NONE)
            return self.finish(self._report(view, piece, run, trigger, timings, actions=(
                f"couldn't read job {rec.job_id}: {exc}",)))
        if run_hint is not None and restarts_of(run_hint) != job.restarts:
            log.info("ignored hang observations of an earlier run", job_id=rec.job_id,
                     run=run_hint, current=job.restarts)
            return self._report(view, piece, run_hint, trigger, timings)
        # The attempt: Slurm's Restarts and the relaunch inside the allocation (attempt.py);
        # on the batch host the relaunch its own launcher registry holds.
        launch = self.launches.live(rec.job_id) if self.launches is not None else None
        relaunch = relaunch_of(run if run_hint is None else run_hint)
        if launch is not None:
            if relaunch < launch.relaunch:
                log.info("ignored hang observations of an earlier relaunch", job_id=rec.job_id,
                         relaunch=relaunch, current=launch.relaunch)
                return self._report(view, piece, run, trigger, timings)
            relaunch = launch.relaunch
        run = job.restarts + RELAUNCH_STRIDE * relaunch
        nodes = job.nodes or rec.nodes
        self.rdv.publish(rec.job_id, run, job.batch_host, nodes, piece_to_bytes(piece))
        if job.batch_host != self.node:
            decision = Decision(Action.REPORT, f"batch host {job.batch_host} decides and acts",
                                "", -1)
            return self.finish(self._report(view, piece, run, trigger, timings,
                                            decision=decision))
        # The Protocol's deadline is on time.monotonic(), the transport's own clock.
        # Under a launcher only the step's nodes run ranks: a spare sends no piece, and
        # waiting for one cost every relaunch the whole rendezvous_wait_s.
        step_nodes = [n for n in nodes if launch is None or n in launch.nodes]
        gathered = self.rdv.gather(rec.job_id, run, nodes,
                                   time.monotonic() + hb.rendezvous_wait_s, wait_for=step_nodes)
        pieces = combine(piece, gathered)
        missing = [n for n in step_nodes if n not in pieces]
        ranks = sorted((r for p in pieces.values() for r in p.ranks), key=lambda r: r.rank)
        evidence = {n: p.evidence for n, p in pieces.items()}
        # Under a launcher only the step's nodes are judged: a spare's own findings (it
        # failed the idle checks while waiting) say nothing about the step's hang.
        judged = {n: p for n, p in pieces.items() if launch is None or n in launch.nodes}
        obs = [o for p in judged.values() for o in p.observations]
        blamed = B.blame(rec.job_id, obs, {n: list(p.findings) for n, p in judged.items()})
        blame_json = _blame_json(blamed, missing)
        report = self._report(view, piece, run, trigger, replace(
            timings, hang_started_at=first_hang(ranks)), ranks=tuple(ranks),
            evidence=evidence, blame=blame_json)
        order: Step | None = None
        try:
            decision = self.decide(cfg, job, view.verdict.mode, blamed,
                                   trigger.startswith("reported"), deadline, run=run)
            decision, order = self._relaunch(job, decision, run, deadline)
        except (DeadlinePassed, JobNotFound) as exc:
            self._count(Action.NONE)
            return self.finish(replace(report, actions=(f"couldn't decide: {exc}",)))
        report = replace(report, decision=decision)
        if decision.action in (Action.REPORT, Action.SKIP):
            if decision.action is Action.REPORT:  # observe mode; a skip was counted before
                self._count(decision.action)
            return self.finish(report)
        basis = ClaimBasis(view.verdict.mode, trigger.startswith("reported"), blamed)
        if not self.store.claim(rec.job_id, run, deadline, basis):
            return self.finish(replace(report, decision=replace(
                decision, action=Action.SKIP,
                reason="another handler already acted on this run")))
        self._count(decision.action)  # once: the claim is persisted, a restart won't count
        if decision.budget_note.startswith("hang budget spent"):  # policy.node_calls' note
            events.count(self.adapter.events_path, events.BUDGET, "incident")
        steps = policy.plan(rec.job_id, decision, job.admin_comment, drain=hb.drain,
                            relaunch=order)
        notes = self._notes(cfg, rec.job_id, decision)
        path = self._write(report)
        done = self._execute(Progress(rec.job_id, run, ProgressState.ACTING, steps, 0, deadline,
                                      path), save_first=True)
        timings = replace(report.timings, action_at=self.clock.time())
        return self.finish(replace(report, actions=tuple(notes + done), timings=timings))

    def _count(self, action: Action) -> None:
        """One hang incident, counted by the agent that decides it (the batch host's)."""
        events.count(self.adapter.events_path, events.INCIDENT, action.value)

    @staticmethod
    def _notes(cfg: Config, job_id: int, decision: Decision) -> list[str]:
        """What the report says before the steps: the budget held nodes back, draining is off."""
        notes: list[str] = [decision.budget_note] if decision.budget_note else []
        if decision.budget_note:
            log.warning("heartbeat: budget: hang budget spent; nodes reported, not taken out",
                        job_id=job_id, note=decision.budget_note)
        if not cfg.heartbeat.drain and any(c.verdict.value != "spare" for c in decision.nodes):
            notes.append("draining is off (heartbeat.drain: false): no node drained")
        return notes

    def _execute(self, progress: Progress, *, save_first: bool = False) -> list[str]:
        """Run the plan from its next step, saving progress after each; the final state."""
        if save_first:
            self.store.save(progress)
        done, complete = execute(self.adapter, progress.job_id, progress.run, progress.plan,
                                 progress.done, progress.deadline, self.clocked,
                                 lambda i: self.store.save(replace(progress, done=i)),
                                 lambda step: self._give(progress.job_id, progress.run, step))

        self.store.save(replace(progress, done=len(progress.plan) if complete else progress.done,
                                state=ProgressState.DONE if complete else ProgressState.GAVE_UP))
        return done

    def _relaunch(self, job: JobInfo, decision: Decision, run: int, deadline: float
                  ) -> tuple[Decision, Step | None]:
        """A requeue becomes a relaunch inside the allocation when the job's launcher is
        alive on this node (the batch host) with a spare that passes the gate now."""
        launch = self.launches.live(job.job_id) if self.launches is not None else None
        if launch is None or decision.action is not Action.REQUEUE:
            return decision, None
        unusable: dict[str, str] = {}
        for spare in launch.spares:
            if spare not in job.nodes:
                unusable[spare] = "not in the job's allocation"
                continue
            info = retry(f"read spare {spare}", lambda s=spare: self.adapter.show_node(s),  # type: ignore[misc]
                         deadline, self.clocked)
            why = RL.gate_reason(info.drained, info.down, info.state, info.reason)
            if why:
                unusable[spare] = why
        decision, order = RL.choose(decision, launch, job_nodes=job.nodes, unusable=unusable,
                                    run=run, admin_comment=job.admin_comment)
        return decision, RL.order_step(order) if order is not None else None

    def _give(self, job_id: int, run: int, step: Step) -> str:
        """Hand a relaunch order to the job's launcher; when it is gone meanwhile (its
        batch host lost, the script ended) the job is requeued as without one."""
        order = RL.order_of(step)
        if self.launches is not None and self.launches.give(job_id, order):
            return (f"ordered the launcher of job {job_id} to relaunch its step (relaunch "
                    f"{order.relaunch}) on {','.join(order.nodes)}")
        done = run_step(self.adapter, job_id, run, Step(StepKind.REQUEUE))
        return f"the launcher of job {job_id} is gone: {done}"

    def decide(self, cfg: Config, job: JobInfo, mode: str, blamed: B.Blame,
               self_reported: bool, deadline: float, run: int | None = None) -> Decision:
        """Gather the root-side facts (node reasons for the budget, committed checkpoint
        steps), then the pure policy."""
        hb = cfg.heartbeat
        now = self.clock.time()
        budget = policy.Budget(0, {}, frozenset())
        if blamed.drains and mode == "act":
            nodes = retry("list nodes for the hang budget", self.adapter.list_nodes, deadline,
                          self.clocked)
            budget = policy.budget_used(nodes, self.adapter.prefix, now)
        calls, note = policy.node_calls(job.job_id, job.user, blamed,
                                        self_reported=self_reported, now=now, budget=budget,
                                        cfg=hb)
        if self_reported and blamed.drains and blamed.rule != "health":
            note = (note + "; " if note else "") + ("reported by the job itself: no node taken "
                                                    "out of service without health findings")
        ckpt = ckptfacts.committed_step(cfg, self.node, job.job_id)
        return policy.decide(job.job_id, run=job.restarts if run is None else run,
                             user=job.user,
                             requeue_allowed=job.requeue, admin_comment=job.admin_comment,
                             ckpt_step=ckpt.step, mode=mode, cfg=hb, calls=calls,
                             budget_note=note, required=job.req_nodes)

    def resume(self, progress: Progress) -> None:
        """Finish acting on an incident a previous life of the agent claimed."""
        try:
            self._resume(progress)
        except Stopping as exc:
            log.warning("heartbeat: resume: left for the agent's next start",
                        job_id=progress.job_id, why=str(exc))

    def _resume(self, progress: Progress) -> None:
        if progress.state is ProgressState.CLAIMED:
            self._redecide(progress)
            return
        log.warning("heartbeat: resume: finishing an incident after an agent restart",
                    job_id=progress.job_id, run=progress.run, done=progress.done,
                    steps=len(progress.plan))
        done = self._execute(progress)
        if progress.report:
            self._amend_report(progress.report, ["(after an agent restart)", *done])
        log.warning("hang incident resumed", job_id=progress.job_id, actions=done)

    def _drop(self, progress: Progress, why: str) -> None:
        self.store.save(replace(progress, state=ProgressState.GAVE_UP))
        log.error("heartbeat: resume: claimed incident dropped", job_id=progress.job_id,
                  run=progress.run, why=why)

    def _redecide(self, progress: Progress) -> None:
        """A claim whose plan was never saved (the agent died in between). Steps run only once
        the plan is saved, so nothing was done: decide again from the claim's basis and
        Slurm's facts of now, then act as a fresh incident would, before its deadline."""
        job_id, run, basis, deadline = (progress.job_id, progress.run, progress.basis,
                                        progress.deadline)
        if basis is None:  # claimed by a release that saved no basis
            self._drop(progress, "the claim holds nothing to decide from")
            return
        if self.clock.time() >= deadline:
            self._drop(progress, "its deadline passed before the agent came back")
            return
        log.warning("heartbeat: resume: deciding again an incident claimed before an agent "
                    "restart", job_id=job_id, run=run)
        cfg = self.cfg()
        try:
            job: JobInfo = retry("read the job", lambda: self.adapter.show_job(job_id),
                                 deadline, self.clocked)
            if job.restarts != restarts_of(run):
                self.store.save(replace(progress, state=ProgressState.DONE))
                log.warning("heartbeat: resume: the job left the claimed run; nothing to do",
                            job_id=job_id, run=run, current=job.restarts)
                return
            decision = self.decide(cfg, job, basis.mode, basis.blame, basis.self_reported,
                                   deadline, run=run)
        except (DeadlinePassed, JobNotFound) as exc:
            self._drop(progress, str(exc))
            return
        steps: tuple[Step, ...] = ()
        if decision.action not in (Action.REPORT, Action.SKIP):
            steps = policy.plan(job_id, decision, job.admin_comment, drain=cfg.heartbeat.drain)
        notes = ["(decided again after an agent restart)",
                 *self._notes(cfg, job_id, decision)]
        path = os.path.join(self.incident_dir,
                            incident.base_name(job_id, run, self.node) + ".json")
        done = self._execute(Progress(job_id, run, ProgressState.ACTING, steps, 0, deadline,
                                      path), save_first=True)
        stub = replace(self._report_stub(job, basis), decision=decision,
                       actions=tuple(notes + done))
        if not self._amend_report(path, stub.actions, stub.to_json()["decision"]):
            # Died before the report was written: keep what is known (no ranks or stacks).
            self._write(stub)
        log.warning("hang incident resumed", job_id=job_id, decision=decision.action.value,
                    actions=done)

    def _report_stub(self, job: JobInfo, basis: ClaimBasis) -> Report:
        return Report(job.job_id, job.restarts, job.user, job.uid, self.node, basis.mode,
                      "claimed before an agent restart", (), {},
                      _blame_json(basis.blame, ()), None, (),
                      Timings(self.clock.time(), 0.0))

    def _amend_report(self, path: str, actions: Sequence[str],
                      decision: DecisionDoc | None = None) -> bool:
        """Add to the report a previous life wrote; False when there is none."""
        try:
            data = incident.read_report(os.path.dirname(path), os.path.basename(path))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            log.error("heartbeat: resume: couldn't update report", path=path, error=str(exc))
            return True
        if decision is not None:
            data["decision"] = decision
        data["actions"] = [*data.get("actions", []), *actions]
        try:
            incident.write_agent_copy(os.path.dirname(path), data)
        except OSError as exc:
            log.error("heartbeat: resume: couldn't update report", path=path, error=str(exc))
        return True

    def _write(self, report: Report) -> str:
        try:
            return incident.write_agent_copy(self.incident_dir, report.to_json())
        except OSError as exc:
            log.error("heartbeat: report: couldn't write incident report",
                      path=self.incident_dir, error=str(exc))
            return ""

    def finish(self, report: Report) -> Report:
        """The report into the agent's directory and the log."""
        path = self._write(report)
        data = report.to_json()
        explanation = report.blame["explanation"] if report.blame else ""
        log.warning("hang incident", job_id=report.job_id, mode=report.mode,
                    decision=data["decision"], blame=explanation,
                    actions=list(report.actions), file=path, timings=data["timings"])
        return report
