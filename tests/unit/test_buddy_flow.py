"""Buddy copies between agents, in one process: three nodes' buddy services on a wire that
hands each message to the receiver's handler (the exchange's munge and TCP are tested on
their own, tests/integration/test_hang_exchange.py), real staging dirs and real files.

A copy reaches the sender's ring buddy, verified; a restore on the spare takes the newest
step from the survivor's part and the lost node's copy; the survivor brings the lost
node's part from the buddy; the protocol refuses what is not for it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
from agent_state import BuddyWatcher, JobNodes
from conftest import free_port

from slurm_resilience.checkpoint.commit import (
    COMMIT,
    begin_part,
    commit_part,
    rank_name,
    step_name,
    write_commit_marker,
)
from slurm_resilience.config import Config
from slurm_resilience.config.checkpoint import CheckpointSection
from slurm_resilience.config.loader import ByteSize
from slurm_resilience.transport.wire import Kind, Message
from slurm_resilience.uploader import buddy_proto as proto
from slurm_resilience.uploader.buddy_handoff import HANDOFF_AFTER_S
from slurm_resilience.uploader.buddy_service import BuddyService
from slurm_resilience.uploader.buddy_source import Where
from slurm_resilience.uploader.buddy_store import Offer
from slurm_resilience.uploader.rootfs import read_step

NODES = ("n1", "n2", "n3")
JOB = 7
SAVE = "0000000000000001-j7.r0.abcd"


class Wire:
    """Messages go straight to the receiving service's handler; a node not on the wire (a
    lost one) takes nothing."""

    def __init__(self) -> None:
        self.services: dict[str, BuddyService] = {}
        self.sent: list[tuple[str, str, bytes]] = []
        self.handlers: dict[str, Any] = {}
        # Where each node's agent listens, when a test gives it (a real loopback socket, or a
        # closed port for a node whose agent is gone); nodes not listed are not looked up.
        self.listening: dict[str, tuple[str, int]] = {}

    def for_node(self, node: str) -> Any:
        wire = self

        class Book:
            def lookup(self, nodes: list[str]) -> dict[str, tuple[str, int]]:
                return {n: wire.listening[n] for n in nodes if n in wire.listening}

        class Transport:
            addresses = Book()

            def on(self, kind: Kind, handler: Any) -> None:
                assert kind is Kind.BUDDY
                wire.handlers[node] = handler

            def send(self, msg: Message, targets: Any) -> str:
                (to,) = targets
                assert msg.sender == node and msg.receiver == to
                wire.sent.append((node, to, msg.pieces[node]))
                handler = wire.handlers.get(to)
                if handler is None:
                    return ""
                return to if handler(msg) == "" else ""
        return Transport()


def _cfg(tmp: Path) -> Config:
    return Config(checkpoint=CheckpointSection(
        enabled=True, staging_root=str(tmp / "{node}" / "nvme"), buddy_copies=True,
        buddy_rate=ByteSize(1 << 30), buddy_wait_s=30.0))


def _node(tmp: Path, wire: Wire, node: str) -> BuddyService:
    root = tmp / node / "nvme"
    (root / f"job-{JOB}").mkdir(parents=True, mode=0o700)
    cfg = _cfg(tmp)
    jobs = {JOB: JobNodes(os.getuid(), NODES)}
    svc = BuddyService(cfg, node, str(tmp / f"events-{node}.json"),
                       BuddyWatcher(cfg, wire.for_node(node), jobs))
    svc._attach()
    wire.services[node] = svc
    return svc


def _save(tmp: Path, node: str, step: int, rank: int, data: bytes, world: int = 2,
          save_id: str = SAVE) -> None:
    job = tmp / node / "nvme" / f"job-{JOB}"
    part = begin_part(job, step, rank)
    (part / "data.distcp").write_bytes(data)
    if rank == 0:
        (part / ".metadata").write_bytes(b"metadata of step %d" % step)
    commit_part(part, step, rank, save_id=save_id)
    write_commit_marker(job, step, world, save_id)


def _join(svc: BuddyService) -> None:
    for state in list(svc.jobs.values()):
        if state.sending is not None:
            state.sending.join(30)


@pytest.fixture
def wire() -> Wire:
    return Wire()


def test_a_commit_goes_to_the_ring_buddy_verified_and_only_the_newest_stays(
        tmp_path: Path, wire: Wire) -> None:
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 10, 0, os.urandom(300_000))
    n1.tick()
    _join(n1)
    assert n2.store.held(JOB)["n1"].step == 10
    assert n1.status(JOB)["sent"] == {"step": 10, "to": "n2", "error": None}
    assert n2.status(JOB)["held"] == {"n1": 10}
    _save(tmp_path, "n1", 20, 0, os.urandom(300_000))
    n1.tick()
    _join(n1)
    assert n2.store.held(JOB)["n1"].step == 20
    held_dir = tmp_path / "n2" / "nvme" / ".buddy" / f"job-{JOB}" / "from-n1"
    assert [p.name for p in held_dir.iterdir()] == [step_name(20)]
    # Every message was one piece: the offer, the data in pieces, the end.
    ops = [proto.decode(raw) for (_, to, raw) in wire.sent if to == "n2"]
    assert isinstance(ops[0], proto.OfferPiece) and isinstance(ops[-1], proto.EndPiece)
    n1.tick()  # nothing new: nothing sent again
    _join(n1)
    assert len([1 for (_, to, _) in wire.sent if to == "n2"]) == len(ops)


def test_the_spare_restores_the_newest_step_from_the_survivor_and_the_buddy_copy(
        tmp_path: Path, wire: Wire) -> None:
    """n1 and n2 ran the step, n3 is the spare (n2's buddy). n2 is lost after committing
    step 20 and sending its copy; S3 has step 10 only. The spare stages step 20 (not 10),
    and brings rank 0 from n1 and rank 1 from its own buddy area."""
    _n1, n2, n3 = (_node(tmp_path, wire, n) for n in NODES)
    rank0, rank1 = os.urandom(200_000), os.urandom(250_000)
    _save(tmp_path, "n1", 20, 0, rank0)
    _save(tmp_path, "n2", 20, 1, rank1)
    n2.tick()
    _join(n2)
    assert n3.store.held(JOB)["n2"].step == 20
    del wire.handlers["n2"]  # lost: nothing reaches it any more
    # Its agent's port takes no connection: a pull never asks it (no send retried for
    # send_timeout_s), while n1, which listens, is asked.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    wire.listening = {"n1": listener.getsockname(), "n2": ("127.0.0.1", free_port())}
    sent_before = len(wire.sent)
    jdir = tmp_path / "n3" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        staged = n3.stage(JOB, fd, os.getgid(), {10}, "")
        assert not [to for (_, to, _) in wire.sent[sent_before:] if to == "n2"]
        assert [to for (_, to, _) in wire.sent[sent_before:] if to == "n1"]
        assert staged is not None and staged.choice.step == 20
        assert [(s.ranks, s.where, s.holder) for s in staged.choice.sources] == [
            ((0,), Where.LOCAL, "n1"), ((1,), Where.BUDDY, "n3")]
        assert (jdir / step_name(20) / COMMIT).is_file()
        assert (jdir / step_name(20) / rank_name(0) / ".metadata").read_bytes() == \
            b"metadata of step 20"
        n3.complete(JOB, fd, os.getgid(), 20)
    finally:
        os.close(fd)
        listener.close()
    assert (jdir / step_name(20) / rank_name(0) / "data.distcp").read_bytes() == rank0
    assert (jdir / step_name(20) / rank_name(1) / "data.distcp").read_bytes() == rank1
    parts = n3.status(JOB)["parts"]
    assert "rank 0 from n1" in parts and "rank 1 from n3 (buddy copy of n2)" in parts


def test_the_survivor_brings_the_lost_nodes_part_from_its_buddy(
        tmp_path: Path, wire: Wire) -> None:
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    rank1 = os.urandom(123_457)
    _save(tmp_path, "n1", 20, 0, os.urandom(1000))
    _save(tmp_path, "n2", 20, 1, rank1)
    n2.tick()
    _join(n2)
    del wire.handlers["n2"]
    jdir = tmp_path / "n1" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        n1.complete(JOB, fd, os.getgid(), 20)
    finally:
        os.close(fd)
    assert (jdir / step_name(20) / rank_name(1) / "data.distcp").read_bytes() == rank1
    assert "rank 1 from n3 (buddy copy of n2)" in n1.status(JOB)["parts"]


def test_a_step_whose_lost_part_has_no_copy_is_passed_over_by_name(
        tmp_path: Path, wire: Wire) -> None:
    """n2 and its buddy n3 both lost before the upload: step 20 can't be had, so the
    stage-in goes to S3's step 10 (stage-in's own path), and the choice names step 20."""
    n1, _n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 20, 0, os.urandom(1000))
    del wire.handlers["n2"], wire.handlers["n3"]
    jdir = tmp_path / "n1" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert n1.stage(JOB, fd, os.getgid(), {10}, "") is None
    finally:
        os.close(fd)


def test_pieces_from_outside_the_job_or_malformed_are_refused(
        tmp_path: Path, wire: Wire) -> None:
    _n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    offer = proto.encode(proto.EndPiece(5, False))
    stranger = Message(Kind.BUDDY, JOB, 0, "n9", "n2", "n9", ("n9", "n2"), {"n9": offer})
    assert "n9 is not a node of job 7" in n2.on_message(stranger)
    other_job = Message(Kind.BUDDY, 8, 0, "n1", "n2", "n1", NODES, {"n1": offer})
    assert "not a node of job 8" in n2.on_message(other_job)
    bad = Message(Kind.BUDDY, JOB, 0, "n1", "n2", "n1", NODES, {"n1": b'{"op":"nope"}'})
    assert "malformed: unknown op" in n2.on_message(bad)
    data = proto.encode(proto.DataPiece(5, False, "rank-00000/x", 0, b"abc"))
    orphan = Message(Kind.BUDDY, JOB, 0, "n1", "n2", "n1", NODES, {"n1": data})
    assert "no transfer of step 5 from n1" in n2.on_message(orphan)
    two = Message(Kind.BUDDY, JOB, 0, "n1", "n2", "n1", NODES, {"n1": offer, "n3": offer})
    assert "one piece" in n2.on_message(two)


def test_an_offer_of_another_nodes_part_that_was_not_asked_for_is_refused(
        tmp_path: Path, wire: Wire) -> None:
    n1, n2, _ = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n3", 20, 1, b"x" * 1000)
    # n3's part, offered by n1 (not its source, and n2 asked nobody for it).
    jdir = tmp_path / "n3" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        marker, manifests = read_step(fd, 20, os.getuid())
    finally:
        os.close(fd)
    offer = Offer(JOB, "n3", 20, marker, manifests, 1000)
    text = proto.offer_text(offer, tuple(p for p, _ in offer.files()))
    msg = Message(Kind.BUDDY, JOB, 0, "n1", "n2", "n1", NODES,
                  {"n1": proto.encode(proto.OfferPiece(20, False, 0, 1, text))})
    assert "n1 offered n3's part, which n2 did not ask for" in n2.on_message(msg)
    assert n1.store.held(JOB) == {}


def test_piece_encoding_round_trips_and_bounds_hold() -> None:
    for piece in (proto.OfferPiece(3, True, 0, 2, "{}"), proto.EndPiece(3, False),
                  proto.DataPiece(3, False, "rank-00001/a/b", 7, b"\x00\xff"),
                  proto.PullPiece(-1, True, True, ("n2",))):
        assert proto.decode(proto.encode(piece)) == piece
    with pytest.raises(proto.ProtoError, match="not a plain relative path"):
        proto.decode(proto.encode(proto.DataPiece(3, False, "../etc/passwd", 0, b"")))
    with pytest.raises(proto.ProtoError, match="out of range"):
        proto.decode(b'{"op":"offer","step":1,"meta":false,"index":2,"count":2,"text":""}')
    room = proto.data_room(65536)
    assert len(proto.encode(proto.DataPiece(1 << 40, False, "rank-00001/data.distcp",
                                            1 << 40, b"x" * room))) < 65536 + 64


def test_ckpt_status_says_where_each_part_came_from_and_the_copies() -> None:
    from slurm_resilience.uploader.cli import format_status

    answer = {"stagein": "done", "step": 100, "source": "buddy", "mode": "metadata",
              "buddy": {"parts": "step 100: rank 0 from node1; rank 1 from node3 (buddy copy "
                                 "of node2)",
                        "sent": {"step": 100, "to": "node1", "error": None},
                        "held": {"node2": 100}}}
    lines = format_status(JOB, "node3", answer)
    assert lines[0] == f"job {JOB} on node3: stage-in done: step 100 from buddy (metadata)"
    assert "  parts of the restore: step 100: rank 0 from node1; rank 1 from node3 (buddy " \
           "copy of node2)" in lines
    assert "  buddy copy: step 100 sent to node1" in lines
    assert "  buddy copy held here: step 100 of node2" in lines
    failed = {**answer, "buddy": {"sent": {"step": 50, "to": "node1", "error": "refused"}}}
    assert "  buddy copy: step 50 sent to node1 FAILED: refused" in format_status(JOB, "n",
                                                                                  failed)


def test_a_transfer_that_stops_arriving_is_dropped_on_an_injected_clock(
        tmp_path: Path, wire: Wire) -> None:
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    now = [1000.0]
    n2.clock = lambda: now[0]
    _save(tmp_path, "n1", 20, 0, b"y" * 5000)
    jdir = tmp_path / "n1" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        marker, manifests = read_step(fd, 20, os.getuid())
    finally:
        os.close(fd)
    offer = Offer(JOB, "n1", 20, marker, manifests, sum(m.total_bytes for m in
                                                       manifests.values()))
    text = proto.offer_text(offer, tuple(p for p, _ in offer.files()))
    msg = Message(Kind.BUDDY, JOB, 0, "n1", "n2", "n1", NODES,
                  {"n1": proto.encode(proto.OfferPiece(20, False, 0, 1, text))})
    assert n2.on_message(msg) == ""
    incoming = tmp_path / "n2" / "nvme" / ".buddy" / f"job-{JOB}" / "from-n1"
    assert [p.name for p in incoming.iterdir()] == [".incoming-" + step_name(20)]
    now[0] += 599
    n2.tick()
    assert [p.name for p in incoming.iterdir()] == [".incoming-" + step_name(20)]
    now[0] += 2
    n2.tick()
    assert list(incoming.iterdir()) == [] and n2.store.transfers == {}
    assert n1.store.held(JOB) == {}


def test_a_jobs_buddy_area_goes_once_the_job_is_gone_for_a_while(
        tmp_path: Path, wire: Wire) -> None:
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 10, 0, b"z" * 1000)
    n1.tick()
    _join(n1)
    now = [50.0]
    n2.clock = lambda: now[0]
    n2.watcher.jobs.clear()  # the job no longer runs here (or the watcher has not read it)
    n2.tick()
    assert n2.store.jobs() == [JOB]
    now[0] += 29
    n2.tick()
    assert n2.store.jobs() == [JOB]
    now[0] += 1
    n2.tick()
    assert n2.store.jobs() == []


def test_parts_of_two_saves_of_one_step_are_never_mixed(tmp_path: Path, wire: Wire) -> None:
    """n2's part of step 20 is of another save than n1's (a requeued run saved step 20
    again): the spare does not stage step 20 from them."""
    _n1, n2, n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 20, 0, b"a" * 1000)
    _save(tmp_path, "n2", 20, 1, b"b" * 1000, save_id="0000000000000009-j7.r1.ffff")
    n2.tick()
    _join(n2)
    del wire.handlers["n2"]
    jdir = tmp_path / "n3" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert n3.stage(JOB, fd, os.getgid(), set(), "S3 down") is None
    finally:
        os.close(fd)
    assert not (jdir / step_name(20)).exists()


def test_a_node_with_nothing_of_the_run_asks_no_one_unless_the_ranks_agreed_on_a_step(
        tmp_path: Path, wire: Wire) -> None:
    """At a job's start no node holds anything: a stage-in whose S3 failed asks no one
    (a 1,024-node job would send a million pulls). ``ckpt.stage`` of a step the ranks
    agreed on (force) asks."""
    n1, _n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n2", 20, 0, b"w" * 1000, world=1)
    jdir = tmp_path / "n1" / "nvme" / f"job-{JOB}"
    fd = os.open(jdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert n1.stage(JOB, fd, os.getgid(), set(), "S3 down") is None
        assert wire.sent == []
        staged = n1.stage(JOB, fd, os.getgid(), set(), "S3 down", force=True)
    finally:
        os.close(fd)
    assert staged is not None and staged.choice.summary() == "step 20: rank 0 local on n2"


def test_a_hand_off_takes_only_copies_of_nodes_no_longer_in_the_job(
        tmp_path: Path, wire: Wire) -> None:
    """n2 holds n1's copy of step 10. While the job runs with n1 in it, n2 never uploads
    n1's part; once the job ended there (the uploader's word), or its run back on n2 leaves
    n1 out (a requeue away from it), the copy is a candidate; of another save or another
    step, or holding none of the missing ranks, never."""
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 10, 0, b"q" * 4000)
    n1.tick()
    _join(n1)
    assert n2.handoffs.candidates(JOB, 10, SAVE, {0}, ended=False) == []
    assert [c.source for c in n2.handoffs.candidates(JOB, 10, SAVE, {0}, ended=True)] == ["n1"]
    n2.watcher.jobs[JOB] = JobNodes(os.getuid(), ("n2", "n3"))  # requeued, n1 excluded
    assert [c.source for c in n2.handoffs.candidates(JOB, 10, SAVE, {0, 1}, ended=False)] == [
        "n1"]
    other = "0000000000000002-j7.r0.beef"
    assert n2.handoffs.candidates(JOB, 10, other, {0}, ended=True) == []
    assert n2.handoffs.candidates(JOB, 20, SAVE, {0}, ended=True) == []
    assert n2.handoffs.candidates(JOB, 10, SAVE, {1}, ended=True) == []


def test_a_lost_node_that_began_its_own_upload_is_given_time_before_the_hand_off(
        tmp_path: Path, wire: Wire) -> None:
    """A source whose intent record of the save is in S3 began its own upload: its copy
    goes up from here only HANDOFF_AFTER_S after a hand-off first became possible (an
    injected clock); one that never began goes up at once."""
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    now = [500.0]
    n2.clock = lambda: now[0]
    _save(tmp_path, "n1", 10, 0, b"r" * 4000)
    n1.tick()
    _join(n1)
    held = n2.handoffs.candidates(JOB, 10, SAVE, {0}, ended=True)
    assert n2.handoffs.ready(JOB, 10, held, announced=set()) == held
    assert n2.handoffs.ready(JOB, 10, held, announced={"n1"}) == []  # first seen at 500
    now[0] += HANDOFF_AFTER_S - 1
    assert n2.handoffs.ready(JOB, 10, held, announced={"n1"}) == []
    now[0] += 1
    assert n2.handoffs.ready(JOB, 10, held, announced={"n1"}) == held


def test_a_jobs_buddy_area_stays_while_the_uploader_has_its_steps_to_finish(
        tmp_path: Path, wire: Wire) -> None:
    """The job is gone from n2, but n2's uploader still has a step of it to upload (a copy
    held here may complete it): the area stays past GONE_AFTER_S, and goes once the
    uploader is done with the job."""
    n1, n2, _n3 = (_node(tmp_path, wire, n) for n in NODES)
    _save(tmp_path, "n1", 10, 0, b"s" * 1000)
    n1.tick()
    _join(n1)

    class Uploader:
        def __init__(self) -> None:
            self.steps: dict[str, dict[str, str]] = {"10": {"state": "waiting-peers"}}

        def current(self, job_id: int) -> dict[str, object] | None:
            return {"job_id": job_id, "steps": self.steps} if self.steps else None

    up = Uploader()
    n2.uploader = up
    now = [50.0]
    n2.clock = lambda: now[0]
    n2.watcher.jobs.clear()
    n2.tick()
    now[0] += 31
    n2.tick()
    assert n2.store.jobs() == [JOB]
    up.steps["10"]["state"] = "committed"
    n2.tick()
    assert n2.store.jobs() == []
