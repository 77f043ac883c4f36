"""The local commit protocol and the manifests that describe a committed step.

A job's staging dir holds one directory per step; each rank commits its part::

    step-00000015/rank-00000.tmp/   a save in progress (ignored, cleaned later)
    step-00000015/rank-00000/       committed: the rank's files + MANIFEST.json
    step-00000015/COMMIT.json       global marker: every rank committed (written last)

A rank's part is written into ``rank-R.tmp/``, each file fsynced, then a manifest
(paths, sizes, CRC32C) is written and fsynced, the directory renamed to ``rank-R/``
and the parent fsynced. A committed part or step is never overwritten. The same
names are used under the run's S3 URI, where COMMIT.json is uploaded last.

Every save of a step has a **save id** (``new_save_id``), decided once by DCP's
coordinator and handed to every rank with the global plan; it is in every rank's
manifest and in the commit marker. A step is whole only when every rank's manifest
carries its marker's save id (``check_save_ids``): a second save of the same step
number (after a job took an older step past a half-uploaded one) goes to the same S3
keys, and the ids keep its ranks from being counted with the first save's. Manifests
and markers written before save ids existed have none (``""``: legacy, one save).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_resilience import safefs
from slurm_resilience.checkpoint.blocks import BLOCK_SIZE, BlockCrcs, file_checksums
from slurm_resilience.checkpoint.crc import Crc32c as Crc32c
from slurm_resilience.checkpoint.crc import crc32c_extend as crc32c_extend
from slurm_resilience.checkpoint.crc import crc_hex as crc_hex
from slurm_resilience.checkpoint.crc import file_crc32c as file_crc32c
from slurm_resilience.checkpoint.crc_combine import combine_parts
from slurm_resilience.checkpoint.errors import CheckpointError as CheckpointError
from slurm_resilience.checkpoint.errors import CorruptStep as CorruptStep

MANIFEST = "MANIFEST.json"
COMMIT = "COMMIT.json"
FORMAT = 2  # 2: per-block CRC32C in manifests
READ_FORMATS = (1, 2)
CHECKSUM = "crc32c"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_RANK_RE = re.compile(r"^rank-(\d{5,})$")
_SAVE_ID_RE = re.compile(r"^[0-9a-f]{16}-[A-Za-z0-9._-]{1,100}$")


class StepExists(CheckpointError):
    """A committed step or rank part already exists and is never overwritten."""


def step_name(step: int) -> str:
    if step < 0:
        raise CheckpointError(f"checkpoint: step {step} must be >= 0")
    return f"step-{step:08d}"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_rank(name: str) -> int | None:
    m = _RANK_RE.match(name)
    return int(m.group(1)) if m else None


def _run_tag(env: Mapping[str, str]) -> str:
    """``j<job>.r<restart count>``: the job's run (a relaunch inside the allocation keeps it)."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "none"
    restart = env.get("SLURM_RESTART_COUNT") or "0"
    job = re.sub(r"[^A-Za-z0-9_-]", "_", job)[:40]
    restart = re.sub(r"[^0-9]", "", restart)[:10] or "0"
    return f"j{job}.r{restart}"


def new_save_id(env: Mapping[str, str] | None = None) -> str:
    """A fresh save id: ``<time_ns, 16 hex>-j<job>.r<restart count>.<nonce>``.

    Ids of one step compare in the order the saves started (the time comes first, fixed
    width), so an agent can tell an earlier save of a step from a later one.
    """
    tag = _run_tag(os.environ if env is None else env)
    return f"{time.time_ns():016x}-{tag}.{secrets.token_hex(4)}"


def saved_in_this_run(save_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``save_id`` is of a save this job's current run made (the same job and
    requeue count: relaunches inside the allocation included); False for "" (legacy)."""
    if not save_id:
        return False
    _, _, rest = save_id.partition("-")
    return rest.rsplit(".", 1)[0] == _run_tag(os.environ if env is None else env)


def check_save_id(value: object, where: str) -> str:
    """A save id read from a manifest, marker or intent record ("" = legacy, none)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not _SAVE_ID_RE.match(value):
        raise CheckpointError(f"checkpoint: {where}: save id {str(value)[:60]!r} is not valid")
    return value


def check_relpath(path: str) -> str:
    """A manifest path: relative, '/'-separated, no '.', '..' or empty parts."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\x00" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise CheckpointError(f"checkpoint: manifest: path {path!r} is not a plain relative path")
    return path


@dataclass(frozen=True)
class FileEntry:
    """One committed file: its size, CRC32C, and the CRC32C of each ``block_size`` block.

    Block CRCs let stage-in verify just the byte ranges a node fetches. Manifests of
    format 1 have none (``blocks == ()``): such files can only be checked whole.
    """

    path: str
    size: int
    crc32c: str
    blocks: tuple[str, ...] = ()
    block_size: int = BLOCK_SIZE

    def to_doc(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "crc32c": self.crc32c,
                "block_size": self.block_size, "blocks": list(self.blocks)}

    @classmethod
    def from_doc(cls, f: Any) -> FileEntry:
        path = check_relpath(str(f["path"]))
        blocks = tuple(str(b) for b in f.get("blocks", ()))
        block_size = int(f.get("block_size", BLOCK_SIZE))
        size = int(f["size"])
        if block_size <= 0 or size < 0:
            raise ValueError(f"size {size} / block_size {block_size} out of range")
        if blocks and len(blocks) != -(-size // block_size):
            raise ValueError(f"{len(blocks)} block checksums for {size} bytes "
                             f"in blocks of {block_size}")
        return cls(path, size, str(f["crc32c"]), blocks, block_size)


@dataclass(frozen=True)
class Manifest:
    """What one rank committed for one step."""

    step: int
    rank: int
    files: tuple[FileEntry, ...]
    save_id: str = ""  # the save this part belongs to ("": written before save ids)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"format": FORMAT, "checksum": CHECKSUM, "step": self.step,
                               "rank": self.rank, "files": [f.to_doc() for f in self.files]}
        if self.save_id:
            doc["save_id"] = self.save_id
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("format") not in READ_FORMATS or doc.get("checksum") != CHECKSUM:
                raise ValueError(f"format {doc.get('format')!r}/{doc.get('checksum')!r} "
                                 f"is not one of {READ_FORMATS}/{CHECKSUM}")
            files = tuple(FileEntry.from_doc(f) for f in doc["files"])
            step, rank = int(doc["step"]), int(doc["rank"])
            save_id = doc.get("save_id")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint: {where}: not a valid manifest: {exc}") from None
        names = [f.path for f in files]
        if len(set(names)) != len(names) or MANIFEST in names:
            raise CheckpointError(f"checkpoint: {where}: duplicate or reserved file names")
        return cls(step=step, rank=rank, files=files, save_id=check_save_id(save_id, where))

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class CommitMarker:
    """Every rank of the step committed its part; written after a barrier."""

    step: int
    world_size: int
    save_id: str = ""  # every rank's manifest carries it ("": written before save ids)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"format": FORMAT, "step": self.step,
                               "world_size": self.world_size}
        if self.save_id:
            doc["save_id"] = self.save_id
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "commit marker") -> CommitMarker:
        try:
            doc = json.loads(data)
            if doc.get("format") not in READ_FORMATS:
                raise ValueError(f"format {doc.get('format')!r} is not one of {READ_FORMATS}")
            marker = cls(step=int(doc["step"]), world_size=int(doc["world_size"]),
                         save_id=check_save_id(doc.get("save_id"), where))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint: {where}: not a valid commit marker: {exc}"
                                  ) from None
        if marker.world_size < 1:
            raise CheckpointError(f"checkpoint: {where}: world_size {marker.world_size} < 1")
        return marker


def check_save_ids(step: int, marker: CommitMarker, manifests: Mapping[int, Manifest],
                   where: str = "") -> None:
    """Every given rank's manifest belongs to the marker's save; else an error naming the
    step and the ranks (a step whose ranks come from two saves of the same step number)."""
    wrong = {r: m.save_id for r, m in sorted(manifests.items()) if m.save_id != marker.save_id}
    if wrong:
        ids = sorted(set(wrong.values()))
        raise CheckpointError(
            f"checkpoint: {where or step_name(step)}: step {step} mixes saves: its commit "
            f"marker is save {marker.save_id or '(legacy, none)'} but the manifests of ranks "
            f"{sorted(wrong)} are save(s) {', '.join(i or '(legacy, none)' for i in ids)}; "
            "refusing it")


# -- durable writes ----------------------------------------------------------------------------

def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write a small file atomically: temp file, fsync, rename, fsync the directory."""
    safefs.write_atomic_path(path, data, durable=True, tmp=f".{path.name}.tmp-{os.getpid()}")


class ChecksummingWriter:
    """A binary file object that computes CRC32C as it writes (torch.save, raw tensors).

    For large writes the checksum of one chunk runs on a helper thread while the next
    chunk is written (both release the GIL), so checksumming costs almost no time.
    """

    PIPELINE_CHUNK = 16 * 1024 * 1024

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.blocks = BlockCrcs()
        self.size = 0
        self._pool: Any = None
        self._pending: list[Any] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < self.PIPELINE_CHUNK and self._pool is None:
            self._checksum(view)
            self._write_all(view)
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                # One worker: checksum updates stay in file order.
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crc32c")
            for start in range(0, n, self.PIPELINE_CHUNK):
                chunk = view[start:start + self.PIPELINE_CHUNK]
                self._pending.append(self._pool.submit(self._checksum, chunk))
                self._write_all(chunk)
            self._pending = [f for f in self._pending if not f.done() or f.result()]
        self.size += n
        return n

    def _checksum(self, view: memoryview) -> None:
        # One pass: the whole file's CRC32C is combined from the blocks' at close().
        self.blocks.update(view)

    def _write_all(self, view: memoryview) -> None:
        while view:
            view = view[os.write(self.fd, view):]

    def flush(self) -> None:
        """Data goes straight to the fd; durability comes from close(fsync=True)."""

    def close(self, fsync: bool = True) -> FileEntry:
        try:
            if self._pool is not None:
                for fut in self._pending:
                    fut.result()
                self._pool.shutdown()
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        blocks = self.blocks.finish()
        bs = self.blocks.block_size
        whole = combine_parts([(int(b, 16), min(bs, self.size - i * bs))
                               for i, b in enumerate(blocks)])
        return FileEntry(self.path.name, self.size, crc_hex(whole), blocks)


# -- the protocol ----------------------------------------------------------------------------

def part_dirs(job_dir: Path, step: int, rank: int) -> tuple[Path, Path]:
    """(tmp dir, final dir) of one rank's part of one step."""
    sdir = job_dir / step_name(step)
    return sdir / f"{rank_name(rank)}.tmp", sdir / rank_name(rank)


def begin_part(job_dir: Path, step: int, rank: int) -> Path:
    """Create a fresh ``rank-R.tmp/`` for a save; a committed part is never overwritten."""
    tmp, final = part_dirs(job_dir, step, rank)
    if final.exists() or (tmp.parent / COMMIT).exists():
        raise StepExists(f"checkpoint: save: step {step} rank {rank} is already committed "
                         f"in {tmp.parent}; committed steps are never overwritten")
    tmp.parent.mkdir(mode=0o700, exist_ok=True)
    if tmp.exists():
        remove_tree(tmp)  # left by a crashed save of this same step
    tmp.mkdir(mode=0o700)
    return tmp


def _walk_files(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = os.path.relpath(dirpath, root)
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                raise CheckpointError(f"checkpoint: commit: {full} is a symlink; "
                                      "checkpoint files must be regular files")
            yield name if rel == "." else f"{rel}/{name}"
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise CheckpointError(f"checkpoint: commit: {dirpath}/{d} is a symlink")


def commit_part(tmp: Path, step: int, rank: int,
                known: Iterable[FileEntry] = (), save_id: str = "") -> Manifest:
    """fsync and checksum every file in ``tmp``, write the manifest, rename, fsync the parent.

    ``known`` holds entries already checksummed while writing, so they are not re-read;
    ``save_id`` is the save the part belongs to (the manifest records it).
    """
    known_by_path = {k.path: k for k in known}
    entries: list[FileEntry] = []
    for rel in _walk_files(tmp):
        if rel == MANIFEST:
            raise CheckpointError(f"checkpoint: commit: {MANIFEST} is a reserved name")
        check_relpath(rel)
        full = tmp / rel
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            entry = known_by_path.get(rel)
            if (entry is None or entry.size != os.fstat(fd).st_size
                    or (entry.size and not entry.blocks)):
                size, crc, blocks = file_checksums(fd)
                entry = FileEntry(rel, size, crc, blocks)
            os.fsync(fd)
        finally:
            os.close(fd)
        entries.append(entry)
    for dirpath, _dirs, _files in os.walk(tmp):
        fsync_dir(dirpath)
    manifest = Manifest(step=step, rank=rank, files=tuple(entries),
                        save_id=check_save_id(save_id, str(tmp)))
    write_durable(tmp / MANIFEST, manifest.to_json())
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():
        raise StepExists(f"checkpoint: commit: {final} already exists; not overwriting")
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return manifest


def write_commit_marker(job_dir: Path, step: int, world_size: int,
                        save_id: str | None = None) -> None:
    """The step is complete on this node: all ranks committed (the caller held a barrier).

    ``save_id`` None: the save id of the rank parts committed on this node (they must all
    agree; a node whose ranks hold parts of different saves raises)."""
    sdir = job_dir / step_name(step)
    sdir.mkdir(mode=0o700, exist_ok=True)
    marker = sdir / COMMIT
    if marker.exists():
        return
    if save_id is None:
        ids = {r: read_manifest(sdir / rank_name(r)).save_id for r in _local_ranks(sdir)}
        if len(set(ids.values())) > 1:
            raise CheckpointError(f"checkpoint: commit: {sdir}: this node's rank parts belong "
                                  f"to different saves ({ids}); not committing the step")
        save_id = next(iter(ids.values()), "")
    write_durable(marker, CommitMarker(step, world_size, check_save_id(save_id, str(sdir))
                                       ).to_json())


def _local_ranks(sdir: Path) -> list[int]:
    out = []
    for name in os.listdir(sdir):
        rank = parse_rank(name)
        if rank is not None and (sdir / name).is_dir() and not (sdir / name).is_symlink():
            out.append(rank)
    return sorted(out)


def read_manifest(part_dir: Path) -> Manifest:
    with open(part_dir / MANIFEST, "rb") as fh:
        return Manifest.from_json(fh.read(), str(part_dir / MANIFEST))


def read_marker(step_dir: Path) -> CommitMarker:
    with open(step_dir / COMMIT, "rb") as fh:
        return CommitMarker.from_json(fh.read(), str(step_dir / COMMIT))


def verify_part(part_dir: Path, expect_step: int | None = None) -> Manifest:
    """Check every file of a committed part against its manifest; raises on any mismatch."""
    manifest = read_manifest(part_dir)
    if expect_step is not None and manifest.step != expect_step:
        raise CheckpointError(f"checkpoint: verify: {part_dir}: manifest says step "
                              f"{manifest.step}, expected {expect_step}")
    for f in manifest.files:
        try:
            size, crc = file_crc32c(part_dir / f.path)
        except OSError as exc:
            raise CheckpointError(f"checkpoint: verify: couldn't read {part_dir / f.path}: "
                                  f"{exc.strerror}") from None
        if size != f.size or crc != f.crc32c:
            raise CheckpointError(f"checkpoint: verify: {part_dir / f.path}: size {size} "
                                  f"crc32c {crc}, expected size {f.size} crc32c {f.crc32c}")
    return manifest


def committed_steps(job_dir: Path) -> list[int]:
    """Steps with a global commit marker, oldest first (not yet verified)."""
    try:
        names = os.listdir(job_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        step = parse_step(name)
        if step is not None and os.path.isfile(job_dir / name / COMMIT) \
                and not os.path.islink(job_dir / name):
            out.append(step)
    return sorted(out)


def verify_step(job_dir: Path, step: int, ranks: Iterable[int] | None = None) -> CommitMarker:
    """A complete step: marker present, and the given ranks' parts (default: all) verify."""
    sdir = job_dir / step_name(step)
    marker = read_marker(sdir)
    if marker.step != step:
        raise CheckpointError(f"checkpoint: verify: {sdir}: marker says step {marker.step}")
    manifests = {rank: verify_part(sdir / rank_name(rank), step)
                 for rank in (range(marker.world_size) if ranks is None else ranks)}
    check_save_ids(step, marker, manifests, str(sdir))
    return marker


def remove_tree(path: Path) -> None:
    """Remove a directory tree of our own making, never following symlinks."""
    from slurm_resilience.checkpoint.staging import remove_tree_nofollow

    remove_tree_nofollow(path)
