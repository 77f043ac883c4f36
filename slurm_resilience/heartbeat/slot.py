"""The heartbeat slot: one fixed-size binary record per rank, in the job's run directory.

The training process maps its slot and overwrites a few fields per step; the
root agent reads it with ``pread`` and :func:`decode`. The format is a fixed
little-endian struct, so the agent parses numbers and one short ASCII name,
never anything that could execute (no pickle, no eval).

Layout (offsets in bytes)::

    0   header, written once: magic "SRHB", version, size, rank, world size,
        local rank, pid, process start time (clock ticks), job id, restart count,
        wall-minus-monotonic clock offset, creation time, job's own step timeout
    72  flags (warm-up, done, per-job opt-out)
    96  seq (seqlock: odd while the dynamic part is being written)
    104 step, last beat time, beats, last/ewma/min/max step time
    160 checkpoint step
    168 section start (or last section exit), section timeout, section name (32 bytes, ASCII)
    256 end

Times are ``CLOCK_MONOTONIC`` seconds: the agent runs on the same node, so it
compares them with its own monotonic clock, and converts to wall time with the
stored offset for reports.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import asdict, dataclass
from typing import Any

MAGIC = b"SRHB"
VERSION = 1
SIZE = 256
NAME_LEN = 32

HEADER = struct.Struct("<4sHHiiiiQQiiddd")  # 0..72
FLAGS = struct.Struct("<I")
FLAGS_OFF = 72
SEQ = struct.Struct("<Q")
SEQ_OFF = 96
BEAT = struct.Struct("<qdQdddd")  # step, last, beats, last_dt, ewma_dt, min_dt, max_dt
BEAT_OFF = 104
CKPT = struct.Struct("<q")
CKPT_OFF = 160
SECTION = struct.Struct(f"<dd{NAME_LEN}s")
SECTION_OFF = 168

assert HEADER.size == FLAGS_OFF and BEAT_OFF + BEAT.size <= CKPT_OFF
assert SECTION_OFF + SECTION.size <= SIZE

# Flag bits a rank sets about itself.
FLAG_WARMUP = 1  # the job says it is still warming up (in addition to the step count)
FLAG_DONE = 2  # the training loop finished: silence from now on is not a hang
FLAG_OBSERVE = 4  # per-job opt-out: report a hang but take no action
FLAG_OFF = 8  # per-job opt-out: do not watch this job at all
# The loop stops on purpose (warned ahead of the time limit, or preempted): set before its
# save, with FLAG_DONE after it; goodput counts the rest of the run as a planned restart.
FLAG_STOPPED = 16

SLOT_NAME = re.compile(r"^hb-rank-(\d{1,7})\.slot$")
_SECTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,32}$")


def slot_filename(rank: int) -> str:
    return f"hb-rank-{rank}.slot"


def clean_section_name(name: str) -> str:
    """Section names go into a fixed ASCII field and into reports: keep them plain."""
    if not _SECTION_NAME.match(name):
        raise ValueError(f"heartbeat: section name {name!r} must be 1-32 characters of "
                         "letters, digits, '_', '.', ':' or '-'")
    return name


class SlotFormatError(ValueError):
    """Bytes that are not a valid heartbeat slot."""


@dataclass(frozen=True)
class SlotView:
    """A consistent reading of one slot."""

    rank: int
    world_size: int
    local_rank: int
    pid: int
    pid_start: int
    job_id: int
    restart_count: int
    clock_offset: float
    created: float
    job_step_timeout_s: float
    flags: int
    step: int
    last_beat: float
    beats: int
    last_dt: float
    ewma_dt: float
    min_dt: float
    max_dt: float
    ckpt_step: int
    section_start: float
    section_timeout_s: float
    section: str

    @property
    def last_progress(self) -> float:
        """Monotonic time of the last sign of progress: a beat, entering or leaving a section."""
        return max(self.created, self.last_beat, self.section_start)

    def wall(self, mono: float) -> float:
        """A monotonic time of this slot as Unix time."""
        return mono + self.clock_offset

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def encode_header(*, rank: int, world_size: int, local_rank: int, pid: int, pid_start: int,
                  job_id: int, restart_count: int, clock_offset: float, created: float,
                  job_step_timeout_s: float) -> bytes:
    """The first bytes of a new slot, up to the flags."""
    return HEADER.pack(MAGIC, VERSION, SIZE, rank, world_size, local_rank, pid, pid_start,
                       job_id, restart_count, 0, clock_offset, created, job_step_timeout_s)


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise SlotFormatError(f"{what} is {value!r}, not a finite number")
    return value


def decode(data: bytes) -> SlotView:
    """Parse a slot; raises :class:`SlotFormatError` naming what is wrong."""
    if len(data) != SIZE:
        raise SlotFormatError(f"slot is {len(data)} bytes, expected {SIZE}")
    (magic, version, size, rank, world, local, pid, pid_start, job_id, restarts, _pad,
     offset, created, job_timeout) = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise SlotFormatError(f"magic is {magic!r}, expected {MAGIC!r}")
    if version != VERSION or size != SIZE:
        raise SlotFormatError(f"version {version} size {size}, expected {VERSION} {SIZE}")
    (flags,) = FLAGS.unpack_from(data, FLAGS_OFF)
    step, last, beats, last_dt, ewma, min_dt, max_dt = BEAT.unpack_from(data, BEAT_OFF)
    (ckpt,) = CKPT.unpack_from(data, CKPT_OFF)
    sec_start, sec_timeout, raw_name = SECTION.unpack_from(data, SECTION_OFF)
    name = raw_name.split(b"\0", 1)[0].decode("ascii", "replace")
    if name and not _SECTION_NAME.match(name):
        raise SlotFormatError(f"section name {name!r} is not plain ASCII")
    if rank < 0 or world < 1 or rank >= world:
        raise SlotFormatError(f"rank {rank} of world size {world}")
    for value, what in ((offset, "clock offset"), (created, "created"), (last, "last beat"),
                        (job_timeout, "step timeout"), (sec_start, "section start"),
                        (sec_timeout, "section timeout"), (last_dt, "step time"),
                        (ewma, "mean step time"), (min_dt, "min step time"),
                        (max_dt, "max step time")):
        _finite(value, what)
    return SlotView(rank, world, local, pid, pid_start, job_id, restarts, offset, created,
                    job_timeout, flags, step, last, beats, last_dt, ewma, min_dt, max_dt, ckpt,
                    sec_start, sec_timeout, name)


def read_consistent(read: Any, attempts: int = 50) -> SlotView:
    """Read a slot with ``read() -> bytes`` until the seqlock shows no writer in between."""
    last_error: SlotFormatError | None = None
    for _ in range(attempts):
        data = read()
        if len(data) != SIZE:
            raise SlotFormatError(f"slot is {len(data)} bytes, expected {SIZE}")
        (seq1,) = SEQ.unpack_from(data, SEQ_OFF)
        if seq1 % 2:
            continue
        again = read()
        (seq2,) = SEQ.unpack_from(again, SEQ_OFF)
        if seq1 != seq2:
            continue
        try:
            return decode(data)
        except SlotFormatError as exc:
            last_error = exc
    if last_error is not None:
        raise last_error
    raise SlotFormatError(f"slot kept changing during {attempts} reads")
