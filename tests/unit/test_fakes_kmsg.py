"""The fake kernel log writes what the NVIDIA driver writes, in /dev/kmsg's record format."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.fakes import kmsg

COLLECTED = (REAL_FIXTURES / "xid" / "xid-lines_collected.txt").read_text()


@pytest.mark.parametrize(("pci", "xid"), [
    ("0000:91:00", 79), ("0000:19:00", 48), ("0000:19:00", 63), ("0000:19:00", 94),
    ("0000:38:00", 13), ("0000:9b:00", 119),
])
def test_xid_messages_are_real_driver_lines(pci: str, xid: int) -> None:
    """Each message the fake logs appears verbatim in the real Xid captures (text after pid)."""
    message = kmsg.xid_message(pci, xid)
    head, _, body = message.partition("name=<unknown>, ")
    assert head == f"NVRM: Xid (PCI:{pci}): {xid}, pid='<unknown>', "
    assert f"): {xid}, " in COLLECTED and body in COLLECTED, body


def test_records_have_the_dev_kmsg_shape(tmp_path: Path) -> None:
    """``prio,seq,usec,flags;message`` with rising sequence numbers and warning priority."""
    path = tmp_path / "kmsg"
    kmsg.append_xid(str(path), "00000000:1B:00.0", 79)
    kmsg.append(str(path), "nvidia-peermem nv_get_p2p_free_callback:127 ERROR", priority=3)
    lines = path.read_text().splitlines()
    assert re.fullmatch(r"4,1,\d+,-;NVRM: Xid \(PCI:0000:1b:00\): 79, .*", lines[0])
    assert re.fullmatch(r"3,2,\d+,-;nvidia-peermem .*", lines[1])
    assert kmsg.kernel_pci("00000000:9B:00.0") == "0000:9b:00"
