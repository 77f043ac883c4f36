"""When ranks disagree on the newest committed step: which step every node can load.

``load_latest`` has each rank name its newest committed step (its agent's stage-in
choice, or its node's newest COMMIT.json). They usually agree. When they don't (a node
whose local leader died before writing its commit marker: step 10 on one node, 5 on
another), each rank's view is gathered and one pure decision is taken here:

* the newest step was staged in from S3 on some node: it is committed in S3, so it is
  the step to resume from. The nodes whose stage-in chose an older one (their agent
  listed S3 before the step's commit landed, or fetching it failed transiently) are
  named in ``fetch``: their agents stage exactly that step in (``ckpt.stage``, see
  catch_up.py), with a warning naming both steps and those nodes. Nothing older is
  taken, since the newer step is whole; if the fetch fails, the load raises naming why;
* otherwise the newest step exists only on some nodes, outside S3: it is incomplete.
  The newest step committed on every node is taken instead, with a warning naming
  both steps and the nodes that lack the newer one (on every rank's stderr and in the
  log). Like stage-in passing over a partial local step, this needs no opt-in: the
  newer step can't be loaded anywhere, and the older one loses less than a fresh start;
* a relaunch inside the allocation (``slurm-resilience launch``): the nodes lacking the
  newest step are all spares that just joined, and the nodes that kept running committed
  it (a commit on any node means every rank's save returned): the spares fetch their share
  of it (``ckpt.stage`` waits for its upload to land, or takes it from the job's nodes),
  the others read their own NVMe. When it can't be had (a node lost right after the
  commit, before its part reached S3 or its buddy), the next older step the others
  committed is fetched instead, loudly (``older``);
* no step is committed on every node: an error naming each node's newest step.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.checkpoint.arrival import ranks_text


@dataclass(frozen=True)
class RankView:
    """One rank's view: its node, its candidate step (-1: none), whether its agent staged
    that step in from S3, and the steps committed in its node's staging dir."""

    rank: int
    node: str
    candidate: int
    from_s3: bool
    committed: tuple[int, ...]
    joined: bool = False  # the node joined the step at a relaunch (a spare)


@dataclass(frozen=True)
class Agreement:
    """The step to load (None: ``error`` says why none can be), and the warning to give."""

    step: int | None
    newest: int
    error: str = ""
    warning: str = ""
    passed_over: tuple[int, ...] = ()  # steps above ``step`` some node has: never loaded
    fetch: tuple[str, ...] = ()  # nodes whose agent must stage ``step`` in first (peers, S3)
    # A relaunch's spares: the older steps every other node committed, newest first, to
    # fetch instead when ``step`` can't be had (its part died with a lost node before it
    # reached S3 or its buddy).
    older: tuple[int, ...] = ()


def _where(views: list[RankView]) -> str:
    """``ranks 2, 3 on node-b``, one group per node."""
    by_node: dict[str, list[int]] = {}
    for v in views:
        by_node.setdefault(v.node, []).append(v.rank)
    return "; ".join(f"{ranks_text(tuple(sorted(r)))} on {node}"
                     for node, r in sorted(by_node.items()))


def agree(views: list[RankView]) -> Agreement:
    """The newest step every rank can load, or why there is none (see the module doc)."""
    newest = max(v.candidate for v in views)
    # A node's steps above its own candidate were passed over by its stage-in.
    usable = [{s for s in v.committed if s <= v.candidate} for v in views]
    lacking = [v for v, steps in zip(views, usable, strict=True) if newest not in steps]
    having = [v for v in views if v not in lacking]
    if any(v.from_s3 and v.candidate == newest for v in views):
        behind = ", ".join(f"step {c}" for c in sorted({v.candidate for v in lacking}))
        fetch = tuple(sorted({v.node for v in lacking}))
        return Agreement(newest, newest, fetch=fetch, warning=(
            f"step {newest} is committed in S3 (staged in for {_where(having)}) but the "
            f"stage-in for {_where(lacking)} chose {behind}; fetching step {newest} from S3 "
            f"on {', '.join(fetch)} so that every rank resumes from step {newest}"))
    if lacking and having and all(v.joined for v in lacking):
        # A relaunch inside the allocation: the nodes that kept running committed the
        # step, so every rank saved it before the fault; the spares fetch their share.
        fetch = tuple(sorted({v.node for v in lacking}))
        kept = set.intersection(*(steps for v, steps in zip(views, usable, strict=True)
                                  if v in having))
        older = tuple(sorted((s for s in kept if s < newest), reverse=True))
        return Agreement(newest, newest, fetch=fetch, older=older, warning=(
            f"step {newest} is committed for {_where(having)}; {_where(lacking)} joined "
            f"the step at a relaunch: fetching their share of step {newest} on "
            f"{', '.join(fetch)}"))
    common = set.intersection(*usable)
    if not common:
        per_node = "; ".join(
            f"{'none' if c < 0 else f'step {c}'} for "
            f"{_where([v for v in views if v.candidate == c])}"
            for c in sorted({v.candidate for v in views}, reverse=True))
        return Agreement(None, newest, error=(
            f"no step is committed on every node (newest: {per_node}), so none "
            "can be loaded everywhere"))
    step = max(common)
    above = tuple(sorted({s for steps in usable for s in steps if s > step}))
    return Agreement(step, newest, passed_over=above, warning=(
        f"resuming from OLDER step {step}, not step {newest}: step {newest} is committed "
        f"only for {_where(having)}, not for {_where(lacking)}, and not in S3, so it is "
        f"incomplete; step {step} is the newest step committed on every node"))
