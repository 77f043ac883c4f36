"""``slurm-resilience check [--json]``: run the health gate by hand and show every finding."""

from __future__ import annotations

import argparse
import json
from typing import Any

from slurm_resilience import config
from slurm_resilience.config.paths import node_name

_KINDS = ("manual", "prolog", "epilog", "healthcheck")


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="run the node health gate and print every finding")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--node", default="", help="node name (default: config, SLURMD_NODENAME, "
                                              "hostname)")
    p.add_argument("--kind", choices=_KINDS, default="manual",
                   help="which hook's check set to run (default: manual, i.e. all checks)")
    p.add_argument("--only", default="",
                   help="comma-separated checks: gpu,xid,kernel,infiniband,nvme,mounts,"
                        "services; diag (active GPU diagnostics, minutes of GPU load) and gdr "
                        "(GPUDirect RDMA loopback per HCA with ib_write_bw) run only when "
                        "named here")
    p.set_defaults(func=run)


def table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width columns: SEVERITY CHECK SUBJECT MESSAGE."""
    head = ("SEVERITY", "CHECK", "SUBJECT", "MESSAGE")
    cells = [head] + [(r["severity"].upper(), r["check"], r["subject"], r["message"])
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join(
        "  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in cells)


def run(args: argparse.Namespace) -> int:
    from slurm_resilience.health import gate

    cfg = config.load(args.config)
    node = node_name(args.node or cfg.node.name)
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown_checks = [x for x in only if x not in gate.CHECKS]
    if unknown_checks:
        from slurm_resilience.cli import UsageError

        raise UsageError(f"check: --only {','.join(unknown_checks)}: unknown check; valid: "
                         f"{','.join(gate.CHECKS)}")
    report = gate.run(cfg, node, args.kind, only=only)
    data = report.to_dict()
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(table(data["findings"]))
        verdict = "healthy" if report.verdict.healthy else f"UNHEALTHY: {data['reason']}"
        print(f"\n{node}: {verdict} ({data['seconds'].get('total', 0) * 1000:.0f} ms)")
    return 0 if report.verdict.healthy else 1
