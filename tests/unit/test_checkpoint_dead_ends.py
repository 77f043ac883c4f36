"""No dead ends: ranks that disagree on the newest step resume from the newest step every
node has (loudly), and a save() that only some ranks call fails fast naming the others.

The multi-rank tests run real ranks (forked processes, gloo on CPU) through
dcp_ranks_dead_ends.py; the decision and the arrival check are also tested directly.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import dcp_ranks
import dcp_ranks_dead_ends as scenarios
import pytest
import torch.distributed as dist

from slurm_resilience.checkpoint.agree import Agreement, RankView, agree
from slurm_resilience.checkpoint.arrival import ArrivalCheck
from slurm_resilience.checkpoint.catch_up import fetch_newest_or_older, rank_view
from slurm_resilience.checkpoint.errors import CheckpointError
from slurm_resilience.checkpoint.stagein_status import StageinStatus


def test_nodes_disagreeing_resume_from_the_newest_step_every_node_has(tmp_path: Path) -> None:
    """Step 2 marked on one node only and step 1 whole on both: every rank loads step 1 and
    warns on its own stderr naming both steps; the run's next save(2) then commits."""
    assert dcp_ranks.run_ranks(scenarios.older_everywhere, 2, tmp_path) == [0, 0]
    for rank in range(2):
        err = (tmp_path / f"stderr-{rank}").read_text()
        assert "WARNING: resuming from OLDER step 1, not step 2" in err, err
        assert "not for rank 1 on" in err, err


def test_save_on_some_ranks_fails_fast_on_every_rank_naming_the_missing(tmp_path: Path) -> None:
    """save(1) on ranks 0 and 1 of 3 raises on both within the arrival deadline naming rank
    2; rank 2's late save(1) raises too; nothing is committed and the next save works."""
    assert dcp_ranks.run_ranks(scenarios.subset_save, 3, tmp_path, timeout_s=100) == [0] * 3
    errors = [(tmp_path / f"error-{r}").read_text() for r in range(3)]
    for err in errors:
        assert "checkpoint: save(1): rank 2 of 3 did not call it within 1s" in err, err
    assert "arrived after the others gave up" in errors[2]
    assert "arrived after" not in errors[0]


def _view(rank: int, node: str, candidate: int, committed: tuple[int, ...],
          from_s3: bool = False) -> RankView:
    return RankView(rank, node, candidate, from_s3, committed)


def test_agree_takes_the_newest_step_on_every_node_naming_both() -> None:
    """10 on node a only, 5 on both: step 5, with a warning naming 10, 5 and node b."""
    got = agree([_view(0, "a", 10, (5, 10)), _view(1, "a", 10, (5, 10)),
                 _view(2, "b", 5, (3, 5))])
    assert got.step == 5 and got.newest == 10 and not got.error and got.passed_over == (10,)
    assert "OLDER step 5, not step 10" in got.warning
    assert "committed only for ranks 0, 1 on a" in got.warning
    assert "not for rank 2 on b, and not in S3" in got.warning


def test_agree_takes_a_step_committed_in_s3_and_names_the_nodes_to_fetch_it() -> None:
    """A newer step another node staged in from S3 is whole: that step, fetched on the
    lagging nodes, with a warning naming both steps and those nodes; never an older one."""
    got = agree([_view(0, "a", 10, (10,), from_s3=True), _view(1, "a", 10, (10,)),
                 _view(2, "b", 5, (5,)), _view(3, "c", 7, (5, 7))])
    assert (got.step, got.newest, got.fetch, got.error) == (10, 10, ("b", "c"), "")
    assert "step 10 is committed in S3 (staged in for ranks 0, 1 on a)" in got.warning
    assert "stage-in for rank 2 on b; rank 3 on c chose step 5, step 7" in got.warning
    assert "fetching step 10 from S3 on b, c" in got.warning


def test_a_relaunchs_own_newer_commit_is_not_said_to_come_from_s3() -> None:
    """After a requeue, the run's stage-in found step 5 in S3; the run then committed 15.
    At a relaunch the survivors take 15 (choose_step.py) and the spare, whose stage-in found
    5, joined: the spare fetches its share of 15 as a relaunch's spare, and nobody is told
    that step 15 came from S3 (its upload may not have landed)."""
    staged = StageinStatus("done", step=5, source="s3")
    survivor = rank_view(0, "a", 15, staged, [5, 10, 15], joined=False)
    spare = rank_view(1, "s", 5, staged, [5], joined=True)
    assert not survivor.from_s3 and spare.from_s3
    got = agree([survivor, spare])
    assert (got.step, got.fetch) == (15, ("s",))
    assert "committed in S3" not in got.warning
    assert "rank 1 on s joined the step at a relaunch: fetching their share of step 15" \
        in got.warning


def test_a_relaunch_falls_back_to_an_older_step_when_the_newest_cant_be_had(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Seen in the fault storm: a node lost right after committing step 1500, before its part
    reached S3 or its buddy. The spare can't fetch 1500, so the relaunch takes the newest
    older step both survivors committed (1440), loudly, instead of failing the relaunch;
    1500 is passed over (a later save(1500) sets the stale local copy aside)."""
    staged = StageinStatus("done", step=1200, source="s3")
    views = [rank_view(0, "a", 1500, staged, [1380, 1440, 1500], joined=False),
             rank_view(1, "b", 1500, staged, [1440, 1500], joined=False),
             rank_view(2, "s", -1, StageinStatus("done"), [], joined=True)]
    got = agree(views)
    assert (got.step, got.fetch, got.older) == (1500, ("s",), (1440,))
    asked: list[int] = []

    def fetch(result: Agreement) -> str:
        asked.append(int(result.newest))
        return "" if result.step == 1440 else "s: step 1500 is not committed in s3://x"

    mgr = SimpleNamespace(rank=0, _passed_over={})
    step, failed = fetch_newest_or_older(mgr, got, fetch)  # type: ignore[arg-type]
    assert (step, failed, asked) == (1440, "", [1500, 1440])
    assert set(mgr._passed_over) == {1500}
    err = capsys.readouterr().err
    assert "step 1500 can't be had on s (s: step 1500 is not committed" in err
    assert "Resuming from OLDER step 1440" in err
    step, failed = fetch_newest_or_older(mgr, got, lambda r: f"s: no {r.step}")  # type: ignore[arg-type]
    assert step == 1500 and failed == "s: no 1500; step 1440: s: no 1440"


def test_agree_ignores_steps_above_a_nodes_stagein_choice() -> None:
    """A step a node's stage-in passed over (above its candidate) is not common."""
    got = agree([_view(0, "a", 10, (5, 10)), _view(1, "b", 5, (5, 10))])
    assert got.step == 5


def test_agree_without_a_common_step_names_each_nodes_newest() -> None:
    """No step on every node: an error naming each node's newest (or none)."""
    got = agree([_view(0, "a", 10, (10,)), _view(1, "b", -1, ())])
    assert got.step is None
    assert "no step is committed on every node (newest: step 10 for rank 0 on a; none " \
           "for rank 1 on b)" in got.error


def _meet_all(store: dist.Store, ranks: list[int], world: int, point: str,
              timeout_s: float) -> dict[int, str]:
    """Each of ``ranks`` meets at ``point`` in a thread; their errors ('' = passed)."""
    out: dict[int, str] = {}

    def one(rank: int) -> None:
        try:
            ArrivalCheck(store, rank, world, timeout_s).meet(point, "save(7)")
            out[rank] = ""
        except CheckpointError as exc:
            out[rank] = str(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_arrival_passes_when_every_rank_comes() -> None:
    """Four ranks meeting at one point all pass."""
    assert _meet_all(dist.HashStore(), [0, 1, 2, 3], 4, "save-7", 30.0) == {r: "" for r in
                                                                             range(4)}


def test_arrival_names_the_missing_ranks_on_every_rank_that_came() -> None:
    """Ranks 0 and 2 of 4 come: both raise naming ranks 1 and 3."""
    out = _meet_all(dist.HashStore(), [0, 2], 4, "save-7", 0.1)
    assert set(out) == {0, 2}
    for err in out.values():
        assert "save(7): ranks 1, 3 of 4 did not call it within 0.1s" in err


def test_arrival_after_the_others_gave_up_raises_at_once() -> None:
    """A rank coming after the others gave up raises too (never enters the collective
    alone), naming itself as late."""
    store = dist.HashStore()
    _meet_all(store, [0], 2, "save-7", 0.1)
    (err,) = _meet_all(store, [1], 2, "save-7", 3600.0).values()
    assert "rank 1 of 2 did not call it" in err and "this rank, 1, arrived after" in err


def test_arrival_keys_of_earlier_saves_are_deleted() -> None:
    """Once everyone met at the next save, the previous save's keys are gone: the job's
    store does not grow with every save."""
    store = dist.HashStore()
    checks = [ArrivalCheck(store, r, 2, 30.0) for r in range(2)]
    for step in (1, 2, 3):
        threads = [threading.Thread(target=c.meet, args=(f"save-{step}", "save")) for c in checks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not store.check(["save-1/0/count"]) and not store.check(["save-2/0/ranks"])
    assert store.check(["save-3/0/count"])


def test_arrival_alone_never_waits() -> None:
    """One rank needs no store at all."""
    ArrivalCheck(None, 0, 1, 0.1).meet("save-1", "save(1)")  # type: ignore[arg-type]
