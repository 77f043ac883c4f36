"""Configuration of topology discovery and leaf pinning (``topology:``).

``slurm-resilience topology generate`` reads these settings and bakes the
ones job_submit.lua needs into the Lua data file it writes, so the plugin
never reads YAML (or anything else) while slurmctld holds its locks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from slurm_resilience.config.loader import setting

# Slurm feature names: letters, digits and a few separators; never an operator (&|[]*(),:).
FEATURE_CHARS = re.compile(r"^[A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class TopologySection:
    """How the fabric is turned into topology.conf, leaf features and job placement."""

    mode: Literal["tree", "feature", "off"] = setting(
        "tree",
        help="tree: job_submit sets --switches (needs TopologyPlugin=topology/tree); "
             "feature: job_submit adds a matching-OR leaf constraint [leafA|leafB|...]; "
             "off: job_submit leaves every job alone")
    wait4switch_s: int = setting(
        300, min=0, max=7 * 86400,
        help="tree mode: how long a job may wait for its leaf count before Slurm gives up "
             "on it and places the job anywhere (the @time of --switches)")
    large_jobs: Literal["min-leaves", "leave"] = setting(
        "min-leaves",
        help="jobs larger than the largest leaf: min-leaves asks for the fewest leaves that "
             "can hold them (tree mode only), leave does nothing")
    opt_out_partitions: tuple[str, ...] = setting(
        default_factory=tuple, help="partitions whose jobs are never pinned")
    opt_out_env: str = setting(
        "SLURM_RESILIENCE_LEAF_PIN",
        help="a job whose environment (batch jobs) or SPANK job environment sets this "
             "variable to off/0/no is not pinned")
    leaf_feature_prefix: str = setting(
        "leaf_", help="prefix of the node feature that names a node's leaf (feature mode)")
    max_feature_leaves: int = setting(
        64, min=1, max=4096,
        help="feature mode: at most this many leaves (the largest) go into one matching-OR "
             "constraint; Slurm tries each alternative in turn")
    storage_hca_patterns: tuple[str, ...] = setting(
        default_factory=lambda: (
            r"(?i)^(oss|mds|mgs|nsd|ddn|lustre|gpfs|weka|vast|stor(age)?)[-_]?\d",
            r"(?i)\b(storage|lustre|gpfs|weka)\b",
        ),
        help="regular expressions (Python syntax, searched in the HCA NodeDescription); "
             "a matching HCA is storage, not compute, and is kept out of topology.conf")
    default_description_patterns: tuple[str, ...] = setting(
        default_factory=lambda: (
            r"^MT\d+\b",
            r"Mellanox Technologies",
            r"^ConnectX",
            r"InfiniHost",
            r"^(NVIDIA|Nvidia) ",
            r"^(localhost|ubuntu|debian|rocky|centos|rhel|fedora|almalinux|\(none\))"
            r"(\.localdomain)?\s",
        ),
        help="regular expressions for factory NodeDescriptions (or placeholder hostnames "
             "such as localhost) that name no host; such HCAs are reported as unknown "
             "(fix the description or map the GUID in the site map)")
    infrastructure_patterns: tuple[str, ...] = setting(
        default_factory=lambda: (r"Aggregation Node", r"(?i)(^|[-_\s])c?ufm($|[-_\s])",
                                 r"(?i)\bgateway\b"),
        help="regular expressions for CAs that belong to the fabric itself (SHARP aggregation "
             "nodes, UFM, gateways): neither hosts nor reported")
    service_host_patterns: tuple[str, ...] = setting(
        default_factory=lambda: (
            r"(?i)^(login|head|headnode|ctl|ctld|slurmctld|slurmdbd|controller|master|mgmt|"
            r"admin|nfs|oss|mds|mgs|storage|stor|dtn|bastion)(\d+|[-_.]|$)",
        ),
        help="regular expressions searched in the host name of an HCA; a matching host "
             "(login, controller, storage...) is kept out of the leaves, like storage HCAs. "
             "With --slurm-conf, hosts slurm.conf lacks are left out too")
    root_switch: str = setting(
        "sr-root",
        help="name of the switch added above the top switches when no single switch reaches "
             "every node (Slurm's topology/tree needs one to span them)")

    def validate(self) -> None:
        if not FEATURE_CHARS.match(self.leaf_feature_prefix):
            raise ValueError(f"leaf_feature_prefix {self.leaf_feature_prefix!r} may hold only "
                             "letters, digits, '_', '.' and '-'")
        if not self.root_switch or not FEATURE_CHARS.match(self.root_switch):
            raise ValueError(f"root_switch {self.root_switch!r} must be a non-empty name of "
                             "letters, digits, '_', '.' and '-'")
        for key in ("storage_hca_patterns", "default_description_patterns",
                    "infrastructure_patterns", "service_host_patterns"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"{key}: {pattern!r} is not a regular expression: "
                                     f"{exc}") from None
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.opt_out_env):
            raise ValueError(f"opt_out_env {self.opt_out_env!r} is not an environment "
                             "variable name")
