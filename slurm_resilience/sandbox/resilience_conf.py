"""The hooks' configuration inside a sandbox: ``<state>/etc/slurm-resilience.yaml``.

Each capability adds its section's sandbox values to :func:`sections` (one
entry per section; per-node paths use ``{node}`` under ``<state>/nodes/{node}``).
The file is validated with :func:`slurm_resilience.config.load` when written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurm_resilience.sandbox.layout import Layout

AGENT_SOCKET = "run/agent.sock"  # under each node's directory


def agent_socket(layout: Layout, node: str) -> Path:
    """Where ``node``'s agent listens (``agent.socket`` below)."""
    return layout.node_dir(node) / AGENT_SOCKET


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
        "nccl": {
            # The GPU test's CPU stand-in: 2 gloo ranks, small messages, a threshold for
            # this class of machine (alone ~0.3 GB/s at 1MiB, 4 nodes at once ~0.05;
            # nccl-slow gives ~0.002). Prologs cap each attempt to fit their 20 s
            # (about 9 s); idle verification, where all 4 nodes start 8 ranks at once on
            # 2 cores, gets 30 s. Off by default: verifying 4 idle nodes every 30 s
            # costs about a quarter of a 2-core host. Tests and demos turn it on with
            # update_resilience_config({"nccl": {"enabled": True}}).
            "enabled": False,
            "backend": "gloo",
            "processes": 2,
            "sizes": ["64KiB", "1MiB"],
            "warmup_iters": 2,
            "iters": 5,
            "thresholds": [{"model": "cpu", "gpus": 2, "size": "1MiB", "min_busbw_gbps": 0.01,
                            "source": "sandbox: 2 gloo ranks on one 2-core host"}],
            "timeout_s": 30.0,
            "retries": 1,
            "validity_s": 600.0,
            "idle_interval_s": 30.0,
            "handoff_timeout_s": 3.0,
            "fault_file": f"{node_root}/nccl-fault.json",
        },
        "health": {
            # Stand-in hardware from sandbox/hardware.py; faults: `sandbox inject`.
            "backend": "fake",
            "scenario_dir": f"{state}/scenarios",
            "resume_after_passes": 2,
            # PCIe AER and /proc/modules are read from per-node stand-ins, never the host's
            # own; the node runs the stand-in scenario's driver, needs nvidia_peermem, and
            # drains on a GPU whose VBIOS differs from its peers'.
            "gpu": {"expected_count": 8,
                    "pci_sysfs_root": f"{node_root}/sys/bus/pci/devices",
                    "expected_driver": "565.", "peermem": "required",
                    "modules_file": f"{node_root}/proc/modules", "uniform_vbios": "fail"},
            "xid": {"source": "file", "path": f"{node_root}/kmsg",
                    "boot_id_file": f"{node_root}/boot_id"},
            # No HCA list or rate: the shipped per-GPU-model defaults (8 HCAs at 400 Gb/s
            # for H100) apply, as at a site that configured none.
            "infiniband": {"sysfs_root": f"{node_root}/sys/class/infiniband"},
            # SMART comes from the node's `nvme` stand-in (first on the health check's
            # PATH, see slurmconf.healthcheck_wrapper); the site's spare floor sits above
            # the drive's own 5% threshold.
            "nvme": {"path": f"{node_root}/nvme", "size_limit": 100 << 30,
                     "min_free": 10 << 30, "smart": True, "min_available_spare": 20,
                     "max_probe_ms": 5000},
            # The node's shared filesystem: a plain directory, not a mount point.
            "mounts": {"paths": [f"{node_root}/shared"], "require_mountpoint": False},
            # Answered by the node's `systemctl` stand-in (an HGX node runs Fabric Manager).
            "services": {"units": ["nvidia-fabricmanager"]},
        },
        "agent": {"socket": f"{node_root}/{AGENT_SOCKET}"},
        # No systemd here: each node's agent runs its hook server.
        "hooks": {"server": "agent"},
        "heartbeat": {
            # Short timeouts so hang tests take seconds; cap = 60 - 10 s below "NCCL".
            "step_timeout_s": 6.0,
            "warmup_timeout_s": 30.0,
            "section_timeouts_s": {"checkpoint": 30.0, "eval": 30.0},
            "section_default_timeout_s": 30.0,
            "nccl_timeout_s": 60.0,
            "nccl_margin_s": 10.0,
            "interval_s": 0.5,
            "evidence_timeout_s": 10.0,
            # The sandbox's baseline exchange is the shared directory; the network exchange
            # (the default at sites) has tests of its own that switch to it.
            "rendezvous": "directory",
            "rendezvous_dir": f"{state}/shared/hang",
            "rendezvous_wait_s": 3.0,
            # Suspects are verified within seconds; an incident retries Slurm for 90 s.
            "verify_poll_s": 1.0,
            "verify_window_s": 180.0,
            "verify_idle_poll_s": 30.0,
            "incident_deadline_s": 90.0,
            # Used with rendezvous: network. Every agent is on 127.0.0.1 (Slurm's
            # NodeAddr), so each listens on a port of its own; fan-out 2 makes node2..node4
            # a tree with an inner node even in a 4-node job.
            "exchange": {
                "bind": "127.0.0.1",
                "ports": {n: layout.agent_port(i) for i, n in enumerate(layout.node_names, 1)},
                "munge_socket": str(layout.munge_socket),
                "fanout": 2,
            },
        },
        # Straggler nodes judged within seconds (summaries every 2 s over the exchange, which
        # in rendezvous: directory is a listener of its own on the ports above).
        "stragglers": {"node_interval_s": 2.0},
        # Every agent is on 127.0.0.1: each serves /metrics on a port of its own.
        "metrics": {"listen_address": "127.0.0.1",
                    "ports": {n: layout.metrics_port(i)
                              for i, n in enumerate(layout.node_names, 1)}},
        "topology": {
            # The sandbox's slurm.conf names each node's leaf feature after the leaf itself.
            "leaf_feature_prefix": "",
            # Short, so a multi-node job of another test never waits long for one leaf.
            "wait4switch_s": 5,
        },
        "checkpoint": {
            "enabled": True,
            "staging_root": f"{node_root}/nvme",
            "allowed_prefix": "s3://ckpt/{user}/",
            "s3_endpoint": layout.s3_endpoint,
            "s3_credentials_file": str(layout.s3_keys_file),
            "part_size": "5MiB",
            # Sandbox jobs with a time limit have one minute (Slurm's smallest): warned
            # 35 s ahead, so a run stops about 25 s after its start (a save here takes
            # ~1 s; a start on a loaded host up to ~10 s) and the tests' runs are short.
            "limit_lead_s": 35.0,
            "retry_initial_s": 0.5,
            "retry_max_s": 5.0,
            "upload_interval_s": 0.5,
            "epilog_wait_s": 10.0,
            "stagein_timeout_s": 120.0,
            # S3 faults in tests show up within seconds, not after the 2-minute default.
            "stagein_retry_s": 8.0,
            "stagein_intent_wait_s": 20.0,
            # Buddy copies (a site's default) have a test of their own that turns them on,
            # with a rate small enough to be seen at work; the baseline stays as it was.
            "buddy_copies": False,
            "buddy_rate": "4MiB",
            "buddy_wait_s": 15.0,
        },
    }
