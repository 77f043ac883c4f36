"""The batch host's probes of a failed step's nodes (real loopback sockets): a listener
takes the connection, a closed port refuses it, and only a node whose slurmd and agent both
refuse counts as unreachable; the tracker needs every probe to miss for the whole time."""

from __future__ import annotations

import socket

from conftest import free_port

from slurm_resilience.hang.nodereach import Reach, Target, UnreachableSince, probe_nodes
from slurm_resilience.transport.reach import connect_error, connect_errors


def test_a_listener_answers_and_a_closed_port_refuses() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        open_port = listener.getsockname()[1]
        closed = free_port()
        assert connect_error(("127.0.0.1", open_port)) == ""
        assert connect_error(("127.0.0.1", closed)) == "connection refused"
        found = probe_nodes([Target("up", ("127.0.0.1", open_port), ("127.0.0.1", closed)),
                             Target("gone", ("127.0.0.1", closed), ("127.0.0.1", closed))])
    assert found["up"] == Reach("up", "", "connection refused")
    assert not found["up"].unreachable  # its slurmd still answers
    assert found["gone"].unreachable
    assert probe_nodes([]) == {} and connect_errors([]) == []


def test_a_node_is_lost_only_after_missing_every_probe_for_the_whole_time() -> None:
    gone, back = Reach("n2", "refused", "refused"), Reach("n2", "", "refused")
    since = UnreachableSince()
    since.update({"n2": gone}, 0.0)
    since.update({"n2": gone}, 4.0)
    assert since.lost(4.0, 5.0) == {}
    since.update({"n2": back}, 4.5)  # one answer: the count starts again
    since.update({"n2": gone}, 6.0)
    assert since.lost(10.9, 5.0) == {}
    assert since.lost(11.0, 5.0) == {"n2": 5.0}
