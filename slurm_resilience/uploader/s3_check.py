"""Checks the bytes read for an upload against the file's manifest, part by part."""

from __future__ import annotations

import re
import threading

from slurm_resilience.checkpoint.crc import crc32c_extend, crc_hex
from slurm_resilience.checkpoint.crc_combine import combine_parts
from slurm_resilience.uploader.s3_errors import ContentMismatch

_CRC_HEX = re.compile(r"[0-9a-f]{8}")


class ContentChecker:
    """Compares the bytes read for an upload with the file's manifest.

    A block wholly inside a part is checked as the part is read; a block that spans
    parts is checked once all its pieces were read (their CRCs combined), so with
    blocks listed, every byte is compared before the upload completes.
    """

    def __init__(self, key: str, size: int, crc: str, blocks: tuple[str, ...], block_size: int):
        self.key, self.size, self.crc = key, size, crc
        self.blocks, self.block_size = blocks, block_size
        if not _CRC_HEX.fullmatch(crc):  # it also goes into S3 metadata: plain hex only
            raise ContentMismatch(f"checkpoint: s3: upload {key}: manifest crc32c {crc!r} is "
                                  "not 8 hex digits; refusing the file")
        self._pieces: dict[int, dict[int, tuple[int, int]]] = {}  # block -> offset -> (crc, n)
        self._lock = threading.Lock()

    def part(self, offset: int, data: bytes) -> int:
        """The CRC32C of a part (read at ``offset``) after checking the blocks it covers."""
        if self.blocks:
            view = memoryview(data)
            end = offset + len(data)
            pos = offset
            while pos < end:
                i = pos // self.block_size
                bstart = i * self.block_size
                bend = min(bstart + self.block_size, self.size)
                cut = min(bend, end)
                piece = crc32c_extend(0, view[pos - offset:cut - offset])
                if pos == bstart and cut == bend:
                    self._compare(i, piece)
                else:
                    self._add_piece(i, pos - bstart, piece, cut - pos, bend - bstart)
                pos = cut
        return crc32c_extend(0, data)

    def _add_piece(self, index: int, at: int, crc: int, length: int, block_len: int) -> None:
        with self._lock:
            pieces = self._pieces.setdefault(index, {})
            pieces[at] = (crc, length)
            if sum(n for _, n in pieces.values()) < block_len:
                return
            del self._pieces[index]
        self._compare(index, combine_parts([pieces[k] for k in sorted(pieces)]))

    def _compare(self, index: int, crc: int) -> None:
        if index >= len(self.blocks) or crc_hex(crc) != self.blocks[index]:
            start = index * self.block_size
            raise ContentMismatch(
                f"checkpoint: s3: upload {self.key}: block {index} (from byte {start}) has "
                f"crc32c {crc_hex(crc)}, the manifest says "
                f"{self.blocks[index] if index < len(self.blocks) else 'no such block'}; "
                "refusing it")

    def whole(self, parts: list[tuple[int, int]]) -> None:
        """The CRC32C of the whole file, rebuilt from its parts, must be the manifest's."""
        got = crc_hex(combine_parts(parts))
        total = sum(length for _, length in parts)
        if total != self.size or got != self.crc:
            raise ContentMismatch(
                f"checkpoint: s3: upload {self.key}: the bytes read have size {total} crc32c "
                f"{got}, the manifest says size {self.size} crc32c {self.crc}; refusing them")
