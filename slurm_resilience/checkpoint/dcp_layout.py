"""Where DCP's pieces lie in a step dir, and which bytes of a stored piece a read needs.

Every rank writes its pieces back to back into ``rank-R/data.distcp`` as raw bytes
(tensors in row-major order, other objects as DCP's ``torch.save`` bytes); the
coordinator's ``.metadata`` maps each piece to a :class:`StoredPiece`. A read of
part of a stored tensor (resharding) needs one or more contiguous byte runs of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from slurm_resilience.checkpoint.commit import rank_name

DATA_FILE = "data.distcp"
METADATA_FILE = ".metadata"
METADATA_RELPATH = f"{rank_name(0)}/{METADATA_FILE}"


def data_relpath(rank: int) -> str:
    """A rank's data file, relative to the step dir (the same on every node)."""
    return f"{rank_name(rank)}/{DATA_FILE}"


@dataclass(frozen=True)
class StoredPiece:
    """One piece DCP asked us to store: ``length`` bytes at ``offset`` of ``relpath``.

    ``shape`` and ``dtype`` are set for tensors (raw row-major bytes) and None for
    objects (``torch.save`` bytes).
    """

    relpath: str
    offset: int
    length: int
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def element_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
                 ) -> list[tuple[int, int]]:
    """The (start, count) element runs of the box ``offsets``+``lengths`` inside a
    row-major tensor of ``shape``, in row-major order of the box.

    Read one after another, the runs fill a contiguous tensor of shape ``lengths``.
    """
    nd = len(shape)
    if len(offsets) != nd or len(lengths) != nd:
        raise ValueError(f"box {list(offsets)}+{list(lengths)} does not match shape {list(shape)}")
    for d in range(nd):
        if offsets[d] < 0 or lengths[d] < 0 or offsets[d] + lengths[d] > shape[d]:
            raise ValueError(f"box {list(offsets)}+{list(lengths)} outside shape {list(shape)}")
    if any(n == 0 for n in lengths):
        return []
    strides = contiguous_strides(shape)
    k = nd - 1
    while k >= 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    if k < 0:  # the whole tensor
        total = 1
        for n in shape:
            total *= n
        return [(0, total)]
    run = lengths[k] * strides[k]
    base = offsets[k] * strides[k]
    outer = [range(offsets[d], offsets[d] + lengths[d]) for d in range(k)]
    return [(base + sum(i * strides[d] for d, i in enumerate(idx)), run)
            for idx in itertools.product(*outer)]
