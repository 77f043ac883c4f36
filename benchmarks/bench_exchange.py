"""Fan-in of a 1,024-node hang incident over the agents' network exchange: the batch host's
decision time (all pieces gathered) and bytes received, tree against flat, in the same run.

Every agent is a real ``NetworkRendezvous`` with its own TCP listener on 127.0.0.1, in this
one process. Munge is replaced by a STAND-IN (``StandInCredentials``: no authentication at
all, benchmark only), because one local munged cannot seal and open 1,024 agents' messages
as fast as 1,024 nodes' munged daemons do; munge's real per-message cost is measured
separately on a private munged and added on paper along the tree's critical path.

Reference, same run: flat fan-in (fan-out 1,023: every node sends straight to the batch
host, whose listener serves at most ``max_connections`` at once). Run::

    .venv/bin/python benchmarks/bench_exchange.py [--nodes 1024] [--fanout 16] [--piece 2048]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import resource
import secrets
import shutil
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

from timing import summarise

from slurm_resilience.config.heartbeat import ExchangeSection
from slurm_resilience.hang.netrendezvous import AddressBook, NetworkRendezvous
from slurm_resilience.transport.credentials import Decoded, MungeCredentials
from slurm_resilience.transport.wire import Kind, Message


class StandInCredentials:
    """BENCHMARK STAND-IN FOR MUNGE: zlib then base64 of the payload (as ``munge --zip=zlib``
    sizes it, without its encryption or MAC), with uid 0 and the time. It authenticates
    nothing; the agent always uses MungeCredentials."""

    def encode(self, payload: bytes) -> bytes:
        head = json.dumps({"uid": 0, "t": int(time.time())}).encode()
        return (b"STANDIN:" + base64.b64encode(head) + b":"
                + base64.b64encode(zlib.compress(payload)))

    def decode(self, credential: bytes) -> Decoded:
        _, head, body = credential.split(b":", 2)
        meta = json.loads(base64.b64decode(head))
        return Decoded(int(meta["uid"]), 0, int(meta["t"]),
                       zlib.decompress(base64.b64decode(body)))


def _piece(node: str, size: int) -> bytes:
    ranks = [{"rank": i, "node": node, "state": "hung", "step": 1200, "idle_s": 31.5,
              "in_collective": True} for i in range(8)]
    body = {"node": node, "ranks": ranks, "findings": [], "pad": ""}
    raw = json.dumps(body)
    # Stacks and paths compress about as well as hex digits: not a run of one letter.
    body["pad"] = secrets.token_hex(max(0, size - len(raw)) // 2)
    return json.dumps(body).encode()


def run_once(nodes: list[str], fanout: int, piece_size: int,
             max_connections: int) -> dict[str, float]:
    """All non-root agents publish at once; returns the batch host's figures."""
    cfg = ExchangeSection(bind="127.0.0.1", fanout=fanout, port=0,
                          addresses=dict.fromkeys(nodes, "127.0.0.1"),
                          max_connections=max_connections,
                          # all simulated agents share one address: no per-peer cap here
                          max_connections_per_peer=4096, send_timeout_s=120,
                          io_timeout_s=30, collect_after_s=60)
    creds = StandInCredentials()
    agents = {n: NetworkRendezvous(cfg, n, credentials=creds) for n in nodes}
    # Each listener took a free port; tell every agent where the others are.
    ports = {n: a.listener.port for n, a in agents.items() if a.listener is not None}
    known = dataclasses.replace(cfg, ports=ports)
    for a in agents.values():
        a.cfg = known
        a.addresses = AddressBook(known, None)
    root = agents[nodes[0]]
    try:
        start = time.monotonic()
        for n in nodes[1:]:
            agents[n].publish(1, 0, nodes[0], nodes, _piece(n, piece_size))
        got = root.gather(1, 0, nodes, start + 120)
        decided = time.monotonic() - start
        assert root.listener is not None
        stats = root.listener.stats
        return {"decision_s": decided, "pieces": len(got),
                "bytes_in": stats.bytes_in, "senders": len(root.senders),
                "messages": sum(root.senders.values()), "peak_open": stats.peak_open,
                "refused": stats.refused_cap,
                "bytes_sent_total": sum(a.sent_bytes for a in agents.values())}
    finally:
        for a in agents.values():
            a.close()


def munge_cost(piece_size: int, fanout: int, samples: int) -> tuple[float, float] | None:
    """Median seconds of munge+unmunge (real CLI, private munged) for one piece and for a
    batch of ``fanout`` pieces; None when munged is not available."""
    munged = shutil.which("munged", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if munged is None or os.geteuid() != 0:
        return None
    d = Path(tempfile.mkdtemp(prefix="sr-bench-munge-"))
    (d / "key").write_bytes(secrets.token_bytes(1024))
    (d / "key").chmod(0o400)
    sock = d / "sock"
    proc = subprocess.Popen([munged, "--foreground", "--force", f"--socket={sock}",
                             f"--key-file={d / 'key'}", f"--seed-file={d / 'seed'}",
                             f"--log-file={d / 'log'}", f"--pid-file={d / 'pid'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        creds = MungeCredentials(socket=str(sock))
        out = []
        for count in (1, fanout):
            nodes = tuple(f"n{i:04d}" for i in range(count + 1))
            msg = Message(Kind.PIECES, 1, 0, nodes[1], nodes[0], nodes[0], nodes,
                          {n: _piece(n, piece_size) for n in nodes[1:]})
            times = []
            for _ in range(samples):
                t0 = time.perf_counter()
                creds.decode(creds.encode(msg.to_payload()))
                times.append(time.perf_counter() - t0)
            out.append(summarise(times).p50)
        return out[0], out[1]
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(d)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024, help="agents simulated")
    parser.add_argument("--fanout", type=int, default=16, help="tree fan-out measured")
    parser.add_argument("--piece", type=int, default=2048, help="bytes per node's piece")
    parser.add_argument("--max-connections", type=int, default=64,
                        help="the batch host's listener cap (heartbeat.exchange default)")
    parser.add_argument("--munge-samples", type=int, default=20,
                        help="munge+unmunge round trips measured")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8 * args.nodes)), hard))
    nodes = [f"n{i:04d}" for i in range(args.nodes)]
    print(f"{args.nodes} agents on loopback, {args.piece}-byte pieces; credentials: STAND-IN "
          "(no munge) in the simulation")
    results = {}
    for name, fanout in (("tree", args.fanout), ("flat (reference)", args.nodes - 1)):
        r = run_once(nodes, fanout, args.piece, args.max_connections)
        results[name] = r
        print(f"  {name:<17} fan-out {fanout:>4}: decision {r['decision_s']:.2f} s, "
              f"{r['pieces']:.0f} pieces, batch host received {r['bytes_in'] / 1e6:.2f} MB "
              f"in {r['messages']:.0f} messages from {r['senders']:.0f} peers, peak "
              f"{r['peak_open']:.0f} open connections, {r['refused']:.0f} refused at the cap; "
              f"all agents sent {r['bytes_sent_total'] / 1e6:.2f} MB")
        time.sleep(1)  # let the previous run's ports close
    tree, flat = results["tree"], results["flat (reference)"]
    print(f"tree/flat: decision time {tree['decision_s'] / flat['decision_s']:.2f}x, bytes at "
          f"the batch host {tree['bytes_in'] / flat['bytes_in']:.2f}x, peers heard by the "
          f"batch host {tree['senders']:.0f} vs {flat['senders']:.0f}")
    cost = munge_cost(args.piece, args.fanout, args.munge_samples)
    if cost is None:
        print("munge: not measured (needs root and munged)")
        return 0
    one, batch = cost
    depth = 0
    while (args.fanout ** (depth + 1) - 1) // max(1, args.fanout - 1) < args.nodes:
        depth += 1
    # Critical path: one seal+open per level (pieces are batched per level); the batch host
    # also opens each of its children's messages, on up to 2 munged threads at once.
    extra = depth * batch + tree["messages"] * batch / 2
    flat_extra = one + flat["messages"] * one / 2
    print(f"munge (real CLI, private munged): seal+open {one * 1e3:.1f} ms for one piece, "
          f"{batch * 1e3:.1f} ms for a batch of {args.fanout}; tree depth {depth}: on paper "
          f"+{extra:.2f} s, decision about {tree['decision_s'] + extra:.2f} s with munge "
          f"(flat: +{flat_extra:.2f} s, about {flat['decision_s'] + flat_extra:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
