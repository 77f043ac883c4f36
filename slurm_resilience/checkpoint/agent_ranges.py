"""``AgentRanges``: a RangeSource that asks the node agent to fetch what a restore reads.

The training side turns its load plan into ByteRanges and calls ``ensure``; the
agent (``ckpt.fetch``) widens them to manifest blocks, fetches the missing ones
from S3 with parallel ranged GETs, verifies them, and answers once all are on
the node. Ranges are merged where they touch and sent in batches that stay below
the agent's request size limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, Answer, call
from slurm_resilience.checkpoint.commit import CheckpointError, CorruptStep
from slurm_resilience.checkpoint.ranges import ByteRange, merge_ranges

BATCH_RANGES = 1024
BATCH_BYTES = 48 * 1024  # below the agent's default max_request_bytes (64 KiB)


def batches(ranges: Sequence[ByteRange]) -> Iterator[list[list[Any]]]:
    """``[[relpath, offset, length], ...]`` lists small enough for one agent request."""
    batch: list[list[Any]] = []
    size = 0
    for r in ranges:
        item = [r.relpath, r.offset, r.length]
        n = len(json.dumps(item)) + 2
        if batch and (len(batch) >= BATCH_RANGES or size + n > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


class AgentRanges:
    """Ranges of a step made present on this node by the agent (the job's owner only)."""

    def __init__(self, socket_path: str, job_id: int, timeout_s: float = 3600.0) -> None:
        self.socket_path = socket_path
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.last: Answer = {}

    def ensure(self, step: int, ranges: Sequence[ByteRange]) -> None:
        for batch in batches(merge_ranges(ranges)):
            try:
                self.last = call(self.socket_path, "ckpt.fetch", timeout=self.timeout_s,
                                 job_id=self.job_id, step=step, ranges=batch)
            except AgentRefused as exc:
                kind = CorruptStep if CorruptStep.MARK in str(exc) else CheckpointError
                raise kind(f"checkpoint: load: step {step}: {exc}") from None
            except AgentUnavailable as exc:
                raise CheckpointError(f"checkpoint: load: step {step}: couldn't ask the node "
                                      f"agent to fetch the step's ranges: {exc}") from None
