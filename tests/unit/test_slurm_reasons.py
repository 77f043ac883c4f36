"""Our drain reasons: composed short, recognised by their owner tag whatever their length."""

from __future__ import annotations

from slurm_resilience.slurm import reasons


def test_a_reason_is_its_owners_the_first_finding_and_a_count() -> None:
    """Owners are sorted and unique; one finding has no count."""
    assert reasons.compose("SR:", ["nccl", "health", "nccl"], "gpu0 lost", 2) \
        == "SR: health,nccl: gpu0 lost (+2 more)"
    assert reasons.compose("SR:", ["health"], "gpu0 lost") == "SR: health: gpu0 lost"


def test_an_overlong_finding_is_shortened_never_the_tag_or_count() -> None:
    """At 200 characters the finding gets '...'; owners and count survive."""
    text = reasons.compose("SR:", ["health"], "x" * 500, 7)
    assert len(text) == reasons.MAX_REASON
    assert text.startswith("SR: health: xxx") and text.endswith("x... (+7 more)")


def test_a_crashed_steps_spec_is_owned_by_the_hooks() -> None:
    """A step spec such as ``pkg.mod:func`` is not a tag; it becomes ``hooks``."""
    assert reasons.compose("SR:", ["pkg.mod:prolog"], "crashed") == "SR: hooks: crashed"


def test_parse_finds_the_owners_of_ours_and_nothing_in_others() -> None:
    """Tagged reasons give their owners; an admin's or an untagged one gives None."""
    own = reasons.parse("SR: health,nccl: gpu0 lost (+2 more)", "SR:")
    assert own is not None and own.owners == {"health", "nccl"}
    cut = reasons.parse(reasons.compose("SR:", ["health"], "y" * 400)[:40], "SR:")
    assert cut is not None and cut.owners == {"health"}
    assert reasons.parse("maintenance: new PSU", "SR:") is None
    assert reasons.parse("SR: gpu3 XID 79 (GPU fell off the bus) 12:01:07", "SR:") is None
    assert reasons.parse("SR: hang job 7: rank 1 stalled", "SR:") is None


def test_owned_by_needs_the_owner_alone_or_a_remembered_legacy_reason() -> None:
    """A tag naming only the owner is its drain; shared tags, other owners and admins'
    reasons are not; an untagged reason counts only if an older version remembered it."""
    long = reasons.compose("SR:", ["nccl"], "nccl allreduce " + "z" * 300)[:120]
    assert reasons.owned_by(long, "SR:", "nccl")
    assert not reasons.owned_by("SR: health,nccl: x (+1 more)", "SR:", "nccl")
    assert not reasons.owned_by("SR: health: x", "SR:", "nccl")
    assert not reasons.owned_by("maintenance", "SR:", "nccl", ["maintenance"])
    legacy = "SR: nccl allreduce wrong result on rank1"
    assert reasons.owned_by(legacy, "SR:", "nccl", ["nccl allreduce wrong result on rank1"])
    assert not reasons.owned_by(legacy, "SR:", "nccl")


def test_owners_last_keeps_the_finding_in_sinfos_default_width() -> None:
    """With the owners last, sinfo -R's 20 characters show the finding; parse and owned_by
    recognise that layout and the other alike, so changing the setting orphans no drain."""
    text = reasons.compose("SR:", ["nccl", "health"], "gpu3 XID 79 (GPU fell off the bus)", 2,
                           owners_last=True)
    assert text == "SR: gpu3 XID 79 (GPU fell off the bus) (+2 more) [by health,nccl]"
    assert text[:20] == "SR: gpu3 XID 79 (GPU"
    own = reasons.parse(text, "SR:")
    assert own is not None and own.owners == {"health", "nccl"}
    assert own.text == "gpu3 XID 79 (GPU fell off the bus) (+2 more)"
    alone = reasons.compose("SR:", ["health"], "mount: /scratch unreachable", owners_last=True)
    assert reasons.owned_by(alone, "SR:", "health")
    assert not reasons.owned_by(alone, "SR:", "mount")
    assert reasons.owned_by(reasons.compose("SR:", ["health"], "x"), "SR:", "health")
    long = reasons.compose("SR:", ["health"], "y" * 500, 3, owners_last=True)
    assert len(long) == reasons.MAX_REASON and long.endswith("y... (+3 more) [by health]")
    assert reasons.parse("SR: maintenance [by admin team]", "SR:") is None
