"""Install generated topology files beside a slurm.conf, and make slurmctld pick them up.

Used by the sandbox (and usable by a site's deployment): the tree goes in as a
topology.conf text, runs through the same model, checks and writers as
``slurm-resilience topology generate --from-topology-conf``, and the outputs
land in slurm.conf's directory, where slurmctld reads topology.conf and
job_submit.lua loads its data file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_resilience.config.topology import TopologySection
from slurm_resilience.health.nvlink_domain import NodeFabric
from slurm_resilience.topology import block, generate, model, validate
from slurm_resilience.topology.slurmconf import parse_slurm_conf


class InstallError(ValueError):
    """The topology cannot be installed as given; the message lists the findings."""


def write_generated(etc: Path, topology_text: str, settings: Mapping[str, Any] | TopologySection,
                    slurm_conf: Path) -> model.Fabric:
    """Write topology.conf and the Lua data into ``etc`` from a topology.conf text.

    Refuses (InstallError) what slurmctld would reject, and, in feature mode,
    slurm.conf nodes that lack their leaf feature (the constraint could never
    be met).
    """
    cfg = settings if isinstance(settings, TopologySection) else TopologySection(**settings)
    slurm = parse_slurm_conf(str(slurm_conf))
    lines = validate.parse_topology_conf(topology_text)
    findings = [f for f in validate.check_lines(lines, slurm.nodes) if f.error]
    fabric = model.add_root(model.from_switch_lines(lines, source="topology.conf"),
                            cfg.root_switch)
    if cfg.mode == "feature":
        for node, leaf in sorted(fabric.leaf_of().items()):
            feature = generate.leaf_feature(cfg, leaf)
            if feature not in slurm.features(node):
                findings.append(validate.Finding(True, f"node {node}", f"slurm.conf gives it no "
                                                 f"{feature} feature (feature mode needs it)"))
    if findings:
        raise InstallError("topology: install: " + "; ".join(str(f) for f in findings))
    generate.write_atomic(str(etc / "topology.conf"), generate.topology_conf(fabric))
    generate.write_atomic(str(etc / generate.DATA_FILE), generate.lua_data(fabric, cfg, slurm))
    return fabric


def write_blocks(etc: Path, records: list[NodeFabric], version: tuple[int, int],
                 settings: Mapping[str, Any] | TopologySection, slurm_conf: Path) -> block.Plan:
    """Write the block topology of ``records`` for Slurm ``version`` (topology.conf with
    BlockName= lines, or topology.yaml from 25.05) and job_submit.lua's data (its blocks as
    leaves). Refuses a node slurm.conf has that no block holds."""
    nodes = list(parse_slurm_conf(str(slurm_conf)).nodes)
    plan = block.plan(records, nodes)
    if plan.left_out:
        raise InstallError("topology: install: nodes in no block: " + "; ".join(
            f"{n}: {why}" for n, why in sorted(plan.left_out.items())))
    name, text = block.render(plan, version)
    cfg = settings if isinstance(settings, TopologySection) else TopologySection(**settings)
    generate.write_atomic(str(etc / name), text)
    if name == "topology.yaml":  # Slurm ignores topology.conf then: none to mislead a reader
        (etc / "topology.conf").unlink(missing_ok=True)
    generate.write_atomic(str(etc / generate.DATA_FILE),
                          block.lua_data(plan, cfg, parse_slurm_conf(str(slurm_conf))))
    return plan


def reload_job_submit(script: Path) -> None:
    """Make job_submit/lua reload ``script`` (and so its data) on the next submission.

    The plugin reloads when the script's mtime (whole seconds) is newer than its
    last load; waiting past the current second guarantees that.
    """
    time.sleep(1.1)
    os.utime(script)
