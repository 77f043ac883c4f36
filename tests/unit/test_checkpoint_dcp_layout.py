"""Which bytes of a stored piece a resharded read needs (pure functions)."""

from __future__ import annotations

import torch

from slurm_resilience.checkpoint.dcp_layout import element_runs
from slurm_resilience.checkpoint.ranges import ByteRange, merge_ranges


def test_row_block_is_one_run_and_column_block_one_run_per_row() -> None:
    """Rows 2-3 of a 6x4 tensor are one contiguous run; columns 1-2 are one run per row."""
    assert element_runs((6, 4), (2, 0), (2, 4)) == [(8, 8)]
    assert element_runs((6, 4), (0, 1), (3, 2)) == [(1, 2), (5, 2), (9, 2)]
    assert element_runs((6, 4), (0, 0), (6, 4)) == [(0, 24)]
    assert element_runs((), (), ()) == [(0, 1)]
    assert element_runs((5, 0), (0, 0), (5, 0)) == []


def test_runs_read_in_order_fill_the_box_exactly() -> None:
    """Read one after another, the runs of any box give that box's elements in row-major
    order (checked against tensor slicing)."""
    t = torch.arange(4 * 5 * 6).reshape(4, 5, 6)
    for offsets, lengths in [((1, 0, 0), (2, 5, 6)), ((0, 2, 0), (4, 2, 6)),
                             ((1, 1, 3), (3, 3, 2)), ((3, 4, 5), (1, 1, 1))]:
        flat = t.reshape(-1)
        got = torch.cat([flat[s:s + n] for s, n in element_runs(t.shape, offsets, lengths)])
        want = t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
        assert torch.equal(got, want.reshape(-1)), (offsets, lengths)


def test_ranges_of_one_file_merge_when_they_touch() -> None:
    """Touching or overlapping ranges of a file merge; other files and gaps stay apart."""
    got = merge_ranges([ByteRange("rank-00001/data.distcp", 100, 50),
                        ByteRange("rank-00000/data.distcp", 0, 10),
                        ByteRange("rank-00001/data.distcp", 0, 100),
                        ByteRange("rank-00001/data.distcp", 160, 10),
                        ByteRange("rank-00001/data.distcp", 120, 5)])
    assert got == [ByteRange("rank-00000/data.distcp", 0, 10),
                   ByteRange("rank-00001/data.distcp", 0, 150),
                   ByteRange("rank-00001/data.distcp", 160, 10)]
