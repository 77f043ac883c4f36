"""CRC32C: the fast implementation in use gives google-crc32c's answers."""

from __future__ import annotations

import random

import google_crc32c

from slurm_resilience.checkpoint import crc


def test_the_fast_crc32c_matches_google_crc32c_on_every_kind_of_buffer() -> None:
    """bytes (short and long), bytearray and memoryview slices, extended from any seed,
    give google-crc32c's CRC32C, whatever implementation is in use."""
    rng = random.Random(3)
    data = rng.randbytes(3 * 1024 * 1024 + 17)
    for seed in (0, 0xFFFFFFFF, rng.getrandbits(32)):
        for piece in (data, data[:100], data[5:5000], bytearray(data),
                      memoryview(bytearray(data))[123:-45]):
            assert crc.crc32c_extend(seed, piece) == google_crc32c.extend(seed, bytes(piece))


def test_isa_l_is_used_when_the_isal_package_is_installed() -> None:
    """With the isal package installed (the s3 extra), restores check blocks with ISA-L's
    CRC32C, the fast one."""
    assert crc.IMPLEMENTATION == "isa-l"
