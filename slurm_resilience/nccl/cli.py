"""``slurm-resilience nccl-test [--json]``: run the NCCL gate on this node by hand.

Runs every configured variant now (whether or not the gate is enabled for the
hooks), prints per variant the verdict, the bus bandwidth at each size and
the threshold, and stores the result in the node's cache (``--no-cache`` not).
It never drains: the hooks do. Exit status: 0 pass, 1 fail, 3 could not check
or the node is being tested already.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from slurm_resilience import config
from slurm_resilience.config.paths import node_name, node_path

if TYPE_CHECKING:
    from slurm_resilience.nccl.cache import ResultDoc

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_UNKNOWN = 3


def register(sub: Any) -> None:
    p = sub.add_parser("nccl-test", help="run the NCCL all_reduce test on this node")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--node", default="", help="node name (default: config, SLURMD_NODENAME, "
                                              "hostname)")
    p.add_argument("--variant", action="append", choices=("intra-node", "ib-loopback"),
                   help="run only this variant (repeatable; default: nccl.variants)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="hard limit of one attempt (default: nccl.timeout_s)")
    p.add_argument("--no-cache", action="store_true", help="don't store the result")
    p.add_argument("--invalidate", action="store_true",
                   help="only mark the cached result stale (e.g. after a repair) and exit")
    p.set_defaults(func=run)


def table(result: ResultDoc) -> str:
    """VARIANT VERDICT SIZE BUSBW, one row per size, then the reason."""
    from slurm_resilience.nccl.bandwidth import fmt_gbps, fmt_size

    rows = [("VARIANT", "VERDICT", "SIZE", "BUSBW GB/s", "EXPECTED")]
    for v in result.get("variants", []):
        expected = f"{v['expected_gbps']:g}" if v["expected_gbps"] is not None else "-"
        sizes = v["busbw_gbps"]
        for size, busbw in sizes.items():
            rows.append((v["variant"], v["verdict"].upper(), fmt_size(int(size)),
                         fmt_gbps(busbw), expected))
        if not sizes:
            rows.append((v["variant"], v["verdict"].upper(), "-", "-", expected))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    for v in result.get("variants", []):
        tries = len(v["attempts"])
        lines.append(f"{v['variant']}: {v['reason']} ({tries} attempt{'s' if tries > 1 else ''})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from slurm_resilience.nccl import cache, gate, schedule

    cfg = config.load(args.config)
    node = node_name(args.node or cfg.node.name)
    section = cfg.nccl
    path = cache.path_for(cfg.node.state_dir, node)
    if args.invalidate:
        done = cache.invalidate(path, "invalidated by hand")
        print(f"{node}: cached NCCL result {'invalidated' if done else 'absent'}")
        return EXIT_PASS
    if args.variant:
        section = dataclasses.replace(section, variants=tuple(dict.fromkeys(args.variant)))
        section.validate()
    lock = schedule.NodeLock(os.path.join(node_path(cfg.node.run_dir, node), schedule.LOCK_NAME))
    if not lock.try_acquire():
        holder = schedule.holder_pid(lock.path)
        print(f"nccl-test: {node} is being tested already (pid {holder}); try again later")
        return EXIT_UNKNOWN
    # A job arriving on the node stops us (its prolog sends SIGTERM): the job wins.
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        fault = node_path(section.fault_file, node) if section.fault_file else ""
        result = gate.run_gate(section, fault_file=fault, timeout_s=args.timeout, stop=stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
        lock.release()
    data = result.to_json()
    # Only a result under the configured settings may stand in for the hooks' test.
    if not args.no_cache and not args.variant and result.verdict != "aborted":
        cache.store(path, data)
    if args.json:
        print(json.dumps({"node": node, **data}, indent=1))
    else:
        print(table(data))
        print(f"\n{node}: {result.verdict.upper()} {result.ranks}x{result.model} "
              f"{result.backend} ({result.seconds:.1f} s)")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL}.get(result.verdict, EXIT_UNKNOWN)
