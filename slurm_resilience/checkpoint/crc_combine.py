"""CRC32C of a whole file from the CRC32Cs of its parts, without reading it again.

Parts of a multipart upload are read and sent in parallel, out of order; the
whole-file CRC32C that the manifest lists is rebuilt from each part's CRC32C by
the usual GF(2) operator (the CRC of a run of zero bytes, applied as a 32x32 bit
matrix). The operator for the common part length is computed once, so combining
10,000 parts costs 10,000 small matrix-vector products.
"""

from __future__ import annotations

from functools import lru_cache

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that advances a CRC32C over ``nbytes`` zero bytes."""
    result = tuple(1 << n for n in range(32))  # identity
    op = _square(_square(_square((_POLY, *(1 << n for n in range(31))))))  # one zero byte
    while nbytes:
        if nbytes & 1:
            result = tuple(_times(op, result[n]) for n in range(32))
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    return result


@lru_cache(maxsize=64)
def _zeros_tables(nbytes: int) -> tuple[tuple[int, ...], ...]:
    """``_zeros_operator(nbytes)`` as four byte-indexed tables: applying it costs four
    lookups instead of a loop over 32 bits (a manifest of a large file has thousands of
    blocks of one length)."""
    mat = _zeros_operator(nbytes)
    return tuple(tuple(_times(mat, b << (8 * k)) for b in range(256)) for k in range(4))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1 = crc(A)``, ``crc2 = crc(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


def combine_parts(parts: list[tuple[int, int]]) -> int:
    """CRC32C of the concatenation of parts given as (crc, length), in order."""
    crc = 0
    for part_crc, length in parts:
        if length <= 0:
            continue
        t0, t1, t2, t3 = _zeros_tables(length)
        crc = (t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF]
               ^ t3[crc >> 24] ^ part_crc)
    return crc
