"""Pure policy of a hang: which nodes are drained (evidence), which are suspects (heuristics),
what the budget allows, what happens to the job, and the plan of Slurm steps.

* A node is drained only for evidence about itself: fresh health findings or Xids (the
  ``health`` rule of :mod:`blame`). A node blamed by heuristics ("stalled first", "not in a
  collective") is a *suspect*: the requeued job excludes it, and it is drained with a
  ``suspect`` reason that its own agent lifts when verification passes.
* Budgets cap how many *suspects* hang handling takes out of service per hour: per job owner
  first, then cluster-wide. Drains on evidence are never budgeted (a user can't make health
  findings on a node, so nobody can spend that room for others). Take-outs are counted from
  Slurm's nodes: the suspect take-outs recorded in each node's Comment (kept across resume,
  see :mod:`takeouts`) and our dated suspect reasons on nodes out now. Past a budget the node
  is reported, not touched; when other users spent the cluster-wide one, the requeued job
  still avoids it (the owner did not spend it).
* The job: requeued per :func:`requeue.decide`; a ``--no-requeue`` job is left or cancelled
  per ``no_requeue_policy``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from slurm_resilience.config.heartbeat import HeartbeatSection
from slurm_resilience.hang import requeue as R
from slurm_resilience.hang import takeouts as T
from slurm_resilience.hang.actions import Step, StepKind
from slurm_resilience.hang.blame import Blame
from slurm_resilience.hang.incidentrecords import Action, Decision, NodeCall, NodeVerdict
from slurm_resilience.hang.takeouts import HangReason as HangReason
from slurm_resilience.slurm.parse import NodeInfo

# Our reasons and the take-out record live in takeouts (actions reads them too).
WINDOW_S = T.WINDOW_S
iso = T.iso
parse_reason = T.parse_reason


def drain_reason(job_id: int, user: str, now: float, what: str) -> str:
    return f"hang job {job_id} user {user} at {iso(now)}: {what}"


def suspect_reason(job_id: int, user: str, now: float, what: str) -> str:
    return f"suspect hang job {job_id} user {user} at {iso(now)}: {what}; verifying"


# A suspect the site keeps in service (suspect_drain off): the requeued job still avoids it.
AVOID_ONLY = " (suspect_drain off)"
# A suspect kept in service because other users' take-outs spent the cluster-wide budget: its
# job's owner spent nothing, so the requeued job still avoids it.
AVOID_SPENT = " (cluster budget spent by others: avoided by the job only)"


@dataclass(frozen=True)
class Budget:
    """Suspect take-outs by hang handling within the last hour, cluster-wide and per user (by
    :func:`takeouts.user_key`), and the nodes out of service as suspects right now."""

    total: int
    by_user: Mapping[str, int]
    nodes: frozenset[str]


def budget_used(nodes: Iterable[NodeInfo], prefix: str, now: float) -> Budget:
    """Count suspect take-outs of the last hour: every one recorded in a node's Comment (it
    stays when the node is resumed) and every node drained or down with one of our suspect
    reasons set within the hour (a take-out whose record was not written yet); the same
    take-out seen both ways counts once. Drains on evidence are not counted (an earlier
    release recorded them in the Comment too: such a record counts until it is an hour old)."""
    events: set[tuple[str, T.TakeOut]] = set()
    out_now: set[str] = set()
    for n in nodes:
        # A record from the future (clock skew between nodes) counts: the budget errs on
        # the side of fewer take-outs.
        events.update((n.name, t) for t in T.parse_comment(n.comment)
                      if now - t.at <= WINDOW_S)
        if not (n.drained or n.down) or not n.reason.startswith(prefix):
            continue
        parsed = parse_reason(n.reason)
        if parsed is None or not parsed.suspect or now - parsed.at > WINDOW_S:
            continue
        out_now.add(n.name)
        events.add((n.name, T.TakeOut.of(parsed)))
    by_user: dict[str, int] = {}
    for _, t in events:
        by_user[t.user] = by_user.get(t.user, 0) + 1
    return Budget(len(events), by_user, frozenset(out_now))


class Room(enum.Enum):
    """Whether a suspect take-out fits the hourly budgets, and which one it would pass."""

    OK = "ok"
    USER = "user"  # the job owner's own share is spent
    CLUSTER = "cluster"  # the cluster-wide cap is spent (by others, the owner within share)


def room(total: int, mine: int, cfg: HeartbeatSection) -> Room:
    """Pure: per user first (one user's jobs spend only that user's share), then the
    cluster-wide cap."""
    if mine + 1 > cfg.budget_per_user_per_hour:
        return Room.USER
    if total + 1 > cfg.budget_per_hour:
        return Room.CLUSTER
    return Room.OK


def spent_note(budget: Budget, user: str, cfg: HeartbeatSection, why: Room,
               nodes: Sequence[str], *, avoided: bool = False) -> str:
    """Why the budget refused ``nodes``, naming whose take-outs spent it (users and counts);
    ``avoided``: the requeued job avoids them (said)."""
    held = ", ".join(nodes)
    mine = budget.by_user.get(T.user_key(user), 0)
    if why is Room.USER:
        return (f"hang budget spent for user {user} ({mine} of "
                f"{cfg.budget_per_user_per_hour} suspect take-outs per hour by their jobs): "
                f"{held} reported, not taken out of service")
    by = ", ".join(f"{u} {n}" for u, n in sorted(budget.by_user.items(),
                                                  key=lambda kv: (-kv[1], kv[0])))
    return (f"hang budget spent cluster-wide ({budget.total} of {cfg.budget_per_hour} suspect "
            f"take-outs per hour, by {by or 'nobody'}; {mine} of "
            f"{cfg.budget_per_user_per_hour} for user {user}): {held} reported, not taken out "
            "of service" + (f"; the requeued job avoids {'it' if len(nodes) == 1 else 'them'}"
                            if avoided else ""))


def node_calls(job_id: int, user: str, blamed: Blame, *, self_reported: bool, now: float,
               budget: Budget, cfg: HeartbeatSection) -> tuple[tuple[NodeCall, ...], str]:
    """Drain (evidence, never budgeted) or suspect (heuristic, within the budgets) per blamed
    node; and a note saying what the budget held back and whose take-outs spent it."""
    calls: list[NodeCall] = []
    if blamed.rule == "health":
        wanted = [(n, NodeVerdict.DRAIN, drain_reason(job_id, user, now, r.split(": ", 1)[-1]))
                  for n, r in blamed.drains]
    elif self_reported:
        wanted = []  # a job's own word never takes a node out of service
    else:
        listed = ",".join(str(r) for r in blamed.ranks)
        what = f"rank{'s' if len(blamed.ranks) > 1 else ''} {listed} stalled first"
        wanted = [(n, NodeVerdict.SUSPECT, suspect_reason(job_id, user, now,
                                                          f"{what} ({blamed.rule})"))
                  for n, _ in blamed.drains]
    total, mine = budget.total, budget.by_user.get(T.user_key(user), 0)
    held: dict[Room, list[str]] = {Room.USER: [], Room.CLUSTER: []}
    for node, verdict, reason in wanted:
        if verdict is NodeVerdict.DRAIN:
            calls.append(NodeCall(node, verdict, reason))
            continue
        if not cfg.suspect_drain:
            calls.append(NodeCall(node, NodeVerdict.SPARE, reason + AVOID_ONLY))
            continue
        fresh = node not in budget.nodes
        why = room(total, mine, cfg) if fresh else Room.OK
        if why is not Room.OK:
            held[why].append(node)
            calls.append(NodeCall(node, NodeVerdict.SPARE,
                                  reason + (AVOID_SPENT if why is Room.CLUSTER else "")))
            continue
        if fresh:
            total, mine = total + 1, mine + 1
        calls.append(NodeCall(node, verdict, reason))
    note = "; ".join(spent_note(budget, user, cfg, why, nodes, avoided=why is Room.CLUSTER)
                     for why, nodes in held.items() if nodes)
    return tuple(calls), note


def exclusion(calls: Sequence[NodeCall], required: Iterable[str] = ()
              ) -> tuple[tuple[str, ...], str]:
    """The nodes a requeued job avoids, and a note on those it can't.

    A node taken out as a suspect is avoided (verification may return it before the job
    starts again), and so is a suspect the site keeps in service (suspect_drain off). A node
    its owner's own budget held back is not: it was not taken out, and nothing about it
    justifies keeping the job away. One held back because other users' take-outs spent the
    cluster-wide budget is (:data:`AVOID_SPENT`): the owner spent nothing. A node the job
    asked for by name (``-w``) is never excluded: the job could not start again (Slurm leaves
    it PENDING with BadConstraints)."""
    avoided = {c.node for c in calls if c.verdict is NodeVerdict.SUSPECT
               or (c.verdict is NodeVerdict.SPARE and c.reason.endswith((AVOID_ONLY,
                                                                         AVOID_SPENT)))}
    named = sorted(avoided & set(required))
    note = (f"the job asked for {','.join(named)} by name: requeued without excluding "
            f"{'it' if len(named) == 1 else 'them'}") if named else ""
    return tuple(sorted(avoided - set(named))), note


def decide(job_id: int, *, run: int, user: str, requeue_allowed: bool, admin_comment: str,
           ckpt_step: int, mode: str, cfg: HeartbeatSection, calls: Sequence[NodeCall],
           budget_note: str, required: Iterable[str] = ()) -> Decision:
    """The job's fate and the nodes' calls, as one decision. ``required``: the nodes the job
    asked for by name."""
    job = R.decide(job_id, restarts=run, admin_comment=admin_comment, ckpt_step=ckpt_step,
                   mode=mode, cfg=cfg)
    action = Action(job.action)
    reason = job.reason
    if action in (Action.REQUEUE, Action.HOLD) and not requeue_allowed:
        action = Action.CANCEL if cfg.no_requeue_policy == "cancel" else Action.LEAVE
        reason = (f"hang job {job_id}: submitted with --no-requeue: "
                  f"{'cancelled' if action is Action.CANCEL else 'left running'} "
                  f"(heartbeat.no_requeue_policy: {cfg.no_requeue_policy}); no node drained")
        calls = [NodeCall(c.node, NodeVerdict.SPARE, c.reason) for c in calls]
    acting = action in (Action.REQUEUE, Action.HOLD)
    if not acting:
        calls = [c if c.verdict is NodeVerdict.SPARE else
                 NodeCall(c.node, NodeVerdict.SPARE, c.reason) for c in calls]
    exclude, named = exclusion(calls, required) if acting else ((), "")
    if named:
        reason = f"{reason}; {named}"
    return Decision(action, reason, job.ledger.token(), ckpt_step, tuple(calls), exclude,
                    budget_note)


def plan(job_id: int, decision: Decision, admin_comment: str, *, drain: bool,
         relaunch: Step | None = None) -> tuple[Step, ...]:
    """The Slurm steps of a decision, in order: nodes first (so no other job lands on a node
    under suspicion), then the job's ledger, then the job (a relaunch: the job, then its
    comment). ``relaunch``: the step that hands a RELAUNCH decision's order to the job's
    launcher (see :mod:`relaunch`)."""
    steps: list[Step] = []
    if decision.action in (Action.REQUEUE, Action.HOLD, Action.RELAUNCH) and drain:
        # Each suspect take-out is then recorded in the node's Comment, where it outlives a
        # resume and keeps counting against the hourly budgets; drains on evidence are not
        # budgeted, so not recorded.
        for c in decision.nodes:
            if c.verdict in (NodeVerdict.DRAIN, NodeVerdict.SUSPECT):
                steps.append(Step(StepKind.DRAIN, c.node, c.reason))
            if c.verdict is NodeVerdict.SUSPECT:
                steps.append(Step(StepKind.RECORD, c.node, c.reason))
    ledger = R.parse_ledger(decision.ledger) or R.Ledger()
    comment = R.merge_comment(admin_comment, ledger, decision.reason)
    if decision.action is Action.REQUEUE:
        steps.append(Step(StepKind.COMMENT, text=comment))
        if decision.exclude:
            # Held while pending so the exclusion is in place before it can start again.
            steps += [Step(StepKind.REQUEUE_HOLD, text=comment),
                      Step(StepKind.EXCLUDE, nodes=decision.exclude),
                      Step(StepKind.RELEASE)]
        else:
            steps.append(Step(StepKind.REQUEUE))
    elif decision.action is Action.RELAUNCH:
        if relaunch is None:
            raise ValueError("a relaunch decision needs its launcher's order")
        # The recovery first: the comment is bookkeeping (a relaunch moves no count), and
        # Slurm refuses updates of a job it resized after a lost node (actions.py).
        steps += [relaunch, Step(StepKind.COMMENT, text=comment)]
    elif decision.action is Action.HOLD:
        steps.append(Step(StepKind.REQUEUE_HOLD, text=comment))
        if decision.exclude:
            steps.append(Step(StepKind.EXCLUDE, nodes=decision.exclude))
    elif decision.action is Action.CANCEL:
        steps.append(Step(StepKind.CANCEL))
    return tuple(steps)
