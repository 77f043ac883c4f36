"""The hooks' configuration inside a sandbox: ``<state>/etc/slurm-resilience.yaml``.

Each capability adds its section's sandbox values to :func:`sections` (one
entry per section; per-node paths use ``{node}`` under ``<state>/nodes/{node}``).
The file is validated with :func:`slurm_resilience.config.load` when written.
"""

from __future__ import annotations

from typing import Any

from slurm_resilience.sandbox.layout import Layout


def sections(layout: Layout) -> dict[str, dict[str, Any]]:
    """Sandbox values of every configuration section, keyed by section name."""
    state = layout.state_dir
    node_root = f"{layout.nodes_dir}/{{node}}"
    return {
        "slurm": {"conf": str(layout.slurm_conf)},
        "logging": {
            "file": f"{state}/log/slurm-resilience.jsonl",
            "syslog": False,
            "level": "info",
        },
        "node": {
            "state_dir": f"{node_root}/state",
            "run_dir": f"{node_root}/run",
        },
    }
