"""GPU model names as NVML reports them, matched the same way everywhere.

``H100`` must match ``NVIDIA H100 80GB HBM3`` but not ``GH100``, and an SXM
figure must not be given to a PCIe or NVL card of the same chip (``NVIDIA H100
PCIe``, ``NVIDIA H200 NVL``, ``NVIDIA A100-PCIE-40GB``): those have other links
and other limits.
"""

from __future__ import annotations

import re

# Words in a name that mark a PCIe or NVL board rather than the SXM module.
VARIANT_WORDS = ("PCIe", "NVL")


def _word(pattern: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", name,
                     re.IGNORECASE) is not None


def variant(name: str) -> str | None:
    """``PCIe`` or ``NVL`` when the name is such a board; None for SXM/superchips."""
    for word in VARIANT_WORDS:
        if _word(word, name):
            return word
    return None


def matches(pattern: str, name: str) -> bool:
    """``pattern`` is a word of ``name``, and a board variant only when the pattern
    names it too (``H100`` ≠ ``NVIDIA H100 PCIe``; ``H100 PCIe`` = it)."""
    if not _word(pattern, name):
        return False
    board = variant(name)
    return board is None or _word(board, pattern)
