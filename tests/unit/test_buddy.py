"""Buddy copies of a node's checkpoint part: the ring, the bandwidth bound, the receiver's
store and its checks, and the restore's choice of source (buddy_*.py in the uploader)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    CommitMarker,
    Manifest,
    begin_part,
    commit_part,
    rank_name,
    step_name,
)
from slurm_resilience.checkpoint.quota import job_quota
from slurm_resilience.testing import FakeClock
from slurm_resilience.uploader.buddy_rate import RateLimiter
from slurm_resilience.uploader.buddy_ring import buddy_of, held_for, ring
from slurm_resilience.uploader.buddy_source import Copy, Where, choose
from slurm_resilience.uploader.buddy_store import (
    AREA,
    BuddyStore,
    JobFacts,
    Offer,
    Refused,
)

NODES = ("n3", "n1", "n2")
SAVE = "0000000000000001-j7.r0.abcd"
BIG = job_quota(1 << 40, 0.5)


# -- the ring ----------------------------------------------------------------------------------

def test_each_node_sends_to_the_next_node_of_the_sorted_list_and_the_last_to_the_first() -> None:
    assert ring(NODES) == ("n1", "n2", "n3")
    assert [buddy_of(n, NODES) for n in ("n1", "n2", "n3")] == ["n2", "n3", "n1"]
    assert [held_for(n, NODES) for n in ("n1", "n2", "n3")] == ["n3", "n1", "n2"]
    assert buddy_of("n1", ["n1"]) is None
    assert buddy_of("n9", NODES) is None
    assert buddy_of("n1", ["n2", "n1", "n2"]) == "n2"


# -- the bandwidth bound -----------------------------------------------------------------------

def test_the_rate_limiter_holds_the_average_rate_with_a_one_second_burst() -> None:
    clock = FakeClock()
    lim = RateLimiter(1000, clock)
    for _ in range(10):
        lim.wait(500)
    # 5,000 bytes at 1,000 B/s: the first second's burst is free, the rest takes 4 s.
    assert clock.monotonic() == pytest.approx(4.0)
    assert lim.waited_s == pytest.approx(4.0)


def test_the_rate_limiter_refills_while_idle_and_never_beyond_its_burst() -> None:
    clock = FakeClock()
    lim = RateLimiter(1000, clock)
    assert lim.wait(1000) == 0
    clock.advance(60)  # idle for a minute: one second's worth only, not sixty
    assert lim.wait(1000) == 0
    assert lim.wait(1000) == pytest.approx(1.0)


def test_a_chunk_larger_than_the_burst_waits_its_own_time() -> None:
    clock = FakeClock()
    lim = RateLimiter(100, clock)
    assert lim.wait(1000) == 0  # the first chunk fills the bucket
    assert lim.wait(1000) == pytest.approx(10.0)


def test_rate_zero_is_unlimited() -> None:
    clock = FakeClock()
    lim = RateLimiter(0, clock)
    assert [lim.wait(1 << 30) for _ in range(3)] == [0, 0, 0]
    assert clock.slept == []


# -- the restore's source ----------------------------------------------------------------------

def _copy(step: int, node: str, ranks: set[int], where: Where, holder: str,
          world: int = 4) -> Copy:
    return Copy(step, node, frozenset(ranks), world, where, holder)


def test_a_buddy_copy_newer_than_s3_gives_the_lost_nodes_part() -> None:
    got = choose([_copy(30, "n1", {0, 1}, Where.LOCAL, "n1"),
                  _copy(30, "n2", {2, 3}, Where.BUDDY, "n3"),
                  _copy(20, "n1", {0, 1}, Where.LOCAL, "n1")], s3_steps=[10, 20])
    assert got.step == 30 and not got.passed_over
    assert [(s.ranks, s.where, s.holder) for s in got.sources] == [
        ((0, 1), Where.LOCAL, "n1"), ((2, 3), Where.BUDDY, "n3")]
    assert got.summary() == "step 30: ranks 0, 1 local on n1; ranks 2, 3 buddy on n3"


def test_the_same_step_in_s3_and_a_buddy_comes_from_s3() -> None:
    got = choose([_copy(30, "n1", {0, 1}, Where.LOCAL, "n1"),
                  _copy(30, "n2", {2, 3}, Where.BUDDY, "n3")], s3_steps=[30])
    assert got.step == 30
    assert [(s.ranks, s.where) for s in got.sources] == [((0, 1), Where.LOCAL),
                                                         ((2, 3), Where.S3)]


def test_an_older_buddy_copy_loses_to_a_newer_step_in_s3() -> None:
    got = choose([_copy(20, "n2", {2, 3}, Where.BUDDY, "n3")], s3_steps=[30])
    assert got.step == 30 and [s.where for s in got.sources] == [Where.S3]


def test_a_part_in_no_copy_passes_over_the_step_by_name() -> None:
    """A node and its buddy both lost before the upload, S3 down: the newest step whose
    every part is reachable is taken, and the step passed over is named with its ranks."""
    got = choose([_copy(30, "n1", {0, 1}, Where.LOCAL, "n1"),
                  _copy(20, "n1", {0, 1}, Where.LOCAL, "n1"),
                  _copy(20, "n2", {2, 3}, Where.BUDDY, "n1")], s3_steps=[],
                 s3_error="connection refused")
    assert got.step == 20
    (passed,) = got.passed_over
    assert passed.step == 30
    assert "ranks 2, 3 of 0..3 are in no reachable copy" in passed.reason
    assert "S3 can't be reached: connection refused" in passed.reason


def test_nothing_reachable_is_no_step_with_every_step_named() -> None:
    got = choose([_copy(30, "n1", {0, 1}, Where.LOCAL, "n1")], s3_steps=[])
    assert got.step is None and [p.step for p in got.passed_over] == [30]
    assert choose([], s3_steps=[]).step is None


def test_local_parts_win_over_every_other_source() -> None:
    got = choose([_copy(30, "n2", {2, 3}, Where.LOCAL, "n3"),
                  _copy(30, "n2", {2, 3}, Where.BUDDY, "n1"),
                  _copy(30, "n1", {0, 1}, Where.BUDDY, "n2")], s3_steps=[])
    assert [(s.ranks, s.where) for s in got.sources] == [((2, 3), Where.LOCAL),
                                                         ((0, 1), Where.BUDDY)]


# -- the receiver's store ----------------------------------------------------------------------

def _part(tmp: Path, step: int, rank: int, data: bytes, save_id: str = SAVE) -> Manifest:
    job = tmp / "src"
    job.mkdir(parents=True, exist_ok=True)
    part = begin_part(job, step, rank)
    (part / "data.distcp").write_bytes(data)
    (part / "sub").mkdir()
    (part / "sub" / "empty").write_bytes(b"")
    return commit_part(part, step, rank, save_id=save_id)


def _offer(tmp: Path, step: int, source: str = "n1", data: bytes = b"x" * 700_000,
           world: int = 4, ranks: tuple[int, ...] = (0, 1)) -> tuple[Offer, dict[str, bytes]]:
    manifests = {r: _part(tmp, step, r, data + bytes([r])) for r in ranks}
    files = {f"{rank_name(r)}/{f.path}": (tmp / "src" / step_name(step) / rank_name(r)
                                          / f.path).read_bytes()
             for r, m in manifests.items() for f in m.files}
    offer = Offer(7, source, step, CommitMarker(step, world, SAVE), manifests,
                  sum(m.total_bytes for m in manifests.values()))
    return offer, files


def _send(store: BuddyStore, offer: Offer, files: dict[str, bytes], chunk: int = 65536,
          job: JobFacts | None = None, cut: int = 0) -> None:
    store.begin(job or JobFacts(7, NODES), offer, BIG, store.used(7))
    last = offer.files()[-1 if offer.files()[-1][1] else -2][0]
    for path, _size in offer.files():
        data = files[path]
        if cut and path == last:
            data = data[:-cut]
        for off in range(0, len(data), chunk):
            store.chunk(7, offer.source, offer.step, path, off, data[off:off + chunk])
    store.finish(7, offer.source, offer.step)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "nvme"
    r.mkdir(mode=0o700)
    return r


def test_a_whole_copy_is_verified_kept_and_readable(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    _send(store, offer, files)
    held = store.held(7)["n1"]
    assert (held.step, held.ranks) == (30, frozenset({0, 1}))
    assert held.total_bytes == offer.total_bytes
    fd = store.open_file(7, "n1", 30, "rank-00001/data.distcp")
    try:
        assert os.pread(fd, 1 << 21, 0) == files["rank-00001/data.distcp"]
    finally:
        os.close(fd)
    sdir = root / AREA / "job-7" / "from-n1" / step_name(30)
    assert (sdir / COMMIT).is_file() and (sdir / "rank-00000" / "sub" / "empty").is_file()
    assert (root / AREA).stat().st_mode & 0o777 == 0o700
    assert store.used(7) == offer.total_bytes


def test_only_the_newest_verified_copy_per_source_is_kept(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    _send(store, *_offer(tmp_path, 30))
    newer, files = _offer(tmp_path, 40)
    store.begin(JobFacts(7, NODES), newer, BIG, 0)
    # While the newer one is under way the older verified copy stays.
    assert store.held(7)["n1"].step == 30
    for path, _ in newer.files():
        store.chunk(7, "n1", 40, path, 0, files[path])
    store.finish(7, "n1", 40)
    assert store.held(7)["n1"].step == 40
    assert sorted(p.name for p in (root / AREA / "job-7" / "from-n1").iterdir()) == \
        [step_name(40)]
    with pytest.raises(Refused, match="already holds step 40 of n1; step 30 is older"):
        store.begin(JobFacts(7, NODES), _offer(tmp_path / "again", 30)[0], BIG, 0)


def test_a_copy_from_a_node_of_another_job_is_refused(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, _ = _offer(tmp_path, 30, source="n9")
    with pytest.raises(Refused, match="n9 is not a node of job 7"):
        store.begin(JobFacts(7, NODES), offer, BIG, 0)
    with pytest.raises(Refused, match="job 7 is not running on n2"):
        store.begin(None, offer, BIG, 0)
    with pytest.raises(Refused, match="job 7 is not running on n2"):
        store.begin(JobFacts(8, NODES), offer, BIG, 0)


def test_a_copy_meant_for_another_buddy_is_refused(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n3")  # n1's buddy is n2
    offer, _ = _offer(tmp_path, 30)
    with pytest.raises(Refused, match="n1's buddy in job 7 is n2, not n3"):
        store.begin(JobFacts(7, NODES), offer, BIG, 0)
    assert not (root / AREA).exists()


def test_a_symlinked_buddy_area_is_refused_never_followed(tmp_path: Path, root: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / AREA).symlink_to(elsewhere)
    store = BuddyStore(str(root), "n2")
    offer, _ = _offer(tmp_path, 30)
    with pytest.raises(Refused, match="is a symlink or not a directory"):
        store.begin(JobFacts(7, NODES), offer, BIG, 0)
    assert list(elsewhere.iterdir()) == []


def test_a_job_level_symlink_or_a_loose_mode_is_refused(tmp_path: Path, root: Path) -> None:
    (root / AREA).mkdir(mode=0o700)
    (root / AREA / "job-7").symlink_to(tmp_path)
    store = BuddyStore(str(root), "n2")
    with pytest.raises(Refused, match="job-7 is a symlink"):
        store.begin(JobFacts(7, NODES), _offer(tmp_path, 30)[0], BIG, 0)
    (root / AREA / "job-7").unlink()
    (root / AREA / "job-7").mkdir(mode=0o755)
    with pytest.raises(Refused, match="mode 755, not this agent's 0700"):
        store.begin(JobFacts(7, NODES), _offer(tmp_path / "b", 30)[0], BIG, 0)


def test_an_offer_past_the_quota_or_with_a_wrong_declared_size_is_refused(
        tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, _ = _offer(tmp_path, 30)
    small = job_quota(offer.total_bytes * 2, 0.5)
    with pytest.raises(Refused, match="past its quota"):
        store.begin(JobFacts(7, NODES), offer, small, 1)
    lying = Offer(offer.job_id, offer.source, offer.step, offer.marker, offer.manifests,
                  offer.total_bytes - 1)
    with pytest.raises(Refused, match="its manifests list"):
        store.begin(JobFacts(7, NODES), lying, BIG, 0)


def test_bytes_past_a_files_declared_size_abort_the_transfer(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    store.begin(JobFacts(7, NODES), offer, BIG, 0)
    path = offer.files()[0][0]
    with pytest.raises(Refused, match="would grow past"):
        store.chunk(7, "n1", 30, path, 0, files[path] + b"more")
    assert "n1" not in store.held(7)
    assert list((root / AREA / "job-7" / "from-n1").iterdir()) == []
    with pytest.raises(Refused, match="no transfer of step 30"):
        store.chunk(7, "n1", 30, path, 0, b"x")


def test_a_chunk_out_of_order_aborts_the_transfer(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    store.begin(JobFacts(7, NODES), offer, BIG, 0)
    path = offer.files()[0][0]
    with pytest.raises(Refused, match=r"expected rank-00000/data\.distcp@0"):
        store.chunk(7, "n1", 30, path, 4096, files[path][4096:8192])


def test_a_torn_copy_is_never_kept(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    with pytest.raises(Refused, match="torn copy"):
        _send(store, offer, files, cut=1000)
    assert store.held(7) == {}
    assert list((root / AREA / "job-7" / "from-n1").iterdir()) == []


def test_a_corrupt_copy_is_never_kept(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    path = "rank-00001/data.distcp"
    bad = bytearray(files[path])
    bad[300_000] ^= 0xFF
    with pytest.raises(Refused, match=r"rank-00001/data.distcp does not verify .*bad blocks \[1\]"):
        _send(store, offer, {**files, path: bytes(bad)})
    assert store.held(7) == {}


def test_one_transfer_per_source_and_a_newer_offer_replaces_an_unfinished_one(
        tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, files = _offer(tmp_path, 30)
    store.begin(JobFacts(7, NODES), offer, BIG, 0)
    with pytest.raises(Refused, match="a transfer of step 30 from n1 is under way"):
        store.begin(JobFacts(7, NODES), offer, BIG, 0)
    newer, nfiles = _offer(tmp_path / "b", 40)
    store.begin(JobFacts(7, NODES), newer, BIG, 0)
    path = offer.files()[0][0]
    with pytest.raises(Refused, match="no transfer of step 30"):
        store.chunk(7, "n1", 30, path, 0, files[path])
    for p, _ in newer.files():
        store.chunk(7, "n1", 40, p, 0, nfiles[p])
    store.finish(7, "n1", 40)
    assert store.held(7)["n1"].step == 40


def test_an_offer_whose_manifests_disagree_with_its_marker_is_refused(
        tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    offer, _ = _offer(tmp_path, 30)
    other = Offer(7, "n1", 30, CommitMarker(30, 4, "0000000000000002-j7.r0.ffff"),
                  offer.manifests, offer.total_bytes)
    with pytest.raises(Refused, match="mixes saves"):
        store.begin(JobFacts(7, NODES), other, BIG, 0)
    narrow = Offer(7, "n1", 30, CommitMarker(30, 1, SAVE), offer.manifests, offer.total_bytes)
    with pytest.raises(Refused, match="world size 1"):
        store.begin(JobFacts(7, NODES), narrow, BIG, 0)


def test_the_jobs_end_removes_its_buddy_area(tmp_path: Path, root: Path) -> None:
    store = BuddyStore(str(root), "n2")
    _send(store, *_offer(tmp_path, 30))
    assert store.jobs() == [7]
    store.remove_job(7)
    assert store.jobs() == [] and store.held(7) == {}
