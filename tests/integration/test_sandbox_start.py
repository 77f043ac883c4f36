"""A sandbox that cannot start says which daemon failed, with the last lines of its log,
as a SandboxError (never a traceback of another type), and leaves no process behind."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, _unavailable, free_port_base, make_traversable

from slurm_resilience.sandbox import control, sweep
from slurm_resilience.sandbox.layout import S3_OFFSET, Layout

pytestmark = pytest.mark.sandbox


@pytest.fixture
def state_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        _unavailable("it needs root (slurmd runs jobs as their users)")
    missing = control.missing_programs()
    if missing:
        _unavailable(f"missing {', '.join(missing)}")
    make_traversable(REPO)
    state = Path(tempfile.mkdtemp(prefix="sr-sandbox-start-", dir="/tmp"))
    state.chmod(0o755)
    yield state
    shutil.rmtree(state, ignore_errors=True)


def _fails(layout: Layout, wait_s: float = 40.0) -> str:
    with pytest.raises(control.SandboxError) as caught:
        control.up(layout, install=False, wait_s=wait_s)
    assert sweep.find(layout.state_dir, control.env_match(layout)) == [], \
        "a failed start left processes"
    print(caught.value)
    return str(caught.value)


def _occupy(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_bad_slurm_conf_line_names_slurmctld_and_its_log(state_dir: Path) -> None:
    layout = Layout(state_dir=state_dir, nodes=1, leaves=1, port_base=free_port_base(1),
                    repo=REPO, slurm_overrides=(("SelectType", "select/bogus"),))
    message = _fails(layout)
    assert message.startswith("sandbox: up: slurmctld ")
    assert "slurmctld.log" in message and "select/bogus" in message


def test_an_occupied_s3_port_names_the_s3_endpoint_and_its_log(state_dir: Path) -> None:
    layout = Layout(state_dir=state_dir, nodes=1, leaves=1, port_base=free_port_base(1),
                    repo=REPO)
    with _occupy(layout.port_base + S3_OFFSET):
        message = _fails(layout)
    assert message.startswith("sandbox: up: s3 exited while starting")
    assert "s3.log" in message and "address already in use" in message.lower()


def test_a_slurmd_that_never_registers_is_named_with_its_log(state_dir: Path) -> None:
    """Its port taken, slurmd 22.05 keeps running without registering (24.11 without
    /sys/fs/cgroup likewise): the error names that slurmd and shows its log."""
    layout = Layout(state_dir=state_dir, nodes=1, leaves=1, port_base=free_port_base(1),
                    repo=REPO)
    with _occupy(layout.slurmd_port(1)):
        message = _fails(layout, wait_s=10)
    assert message.startswith("sandbox: up: slurmd-node1 ")
    assert "slurmd-node1.log" in message
    assert f"({layout.slurmd_port(1)})" in message or "Address already in use" in message
