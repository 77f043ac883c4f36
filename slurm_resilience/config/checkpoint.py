"""Configuration of checkpoint staging: local NVMe tier, S3 tier, stage-in, retention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slurm_resilience.config.loader import ByteSize, setting


@dataclass(frozen=True)
class CheckpointSection:
    """Where checkpoints are staged on the node and how the agent syncs them to S3."""

    enabled: bool = setting(
        False, help="create staging dirs in the prolog and run the agent's uploader")
    staging_root: str = setting(
        "/local/slurm-resilience/ckpt",
        help="node-local (NVMe) root of per-job staging dirs; root-owned; may contain {node}",
    )
    allowed_prefix: str = setting(
        "",
        help="S3 prefix template a job may write under, e.g. s3://bucket/{user}/; "
             "empty: no S3 tier (local only)",
    )
    s3_endpoint: str = setting("", help="S3 endpoint URL; empty: AWS's default for the region")
    s3_region: str = setting("us-east-1", help="S3 region name")
    s3_credentials_file: str = setting(
        "",
        help="root-only file with 'ACCESS_KEY_ID SECRET_ACCESS_KEY' on one line; "
             "empty: boto3's default credential chain",
    )
    part_size: ByteSize = setting(
        ByteSize(64 * 1024**2), min=5 * 1024**2, max=5 * 1024**3,
        help="multipart part size; S3 takes parts of 5MiB to 5GiB, at most 10,000 per object, "
             "so a file that would need more parts is sent in larger ones (objects up to "
             "5TiB); larger parts mean fewer requests",
    )
    concurrency: int = setting(8, min=1, max=128, help="parallel part uploads/downloads per file")
    limit_lead_s: float = setting(
        180.0, min=0, max=86400,
        help="the agent warns the ranks of a job with a run URI this long before its time "
             "limit (they save at the next step boundary and the job is requeued): at least "
             "one step, the save's stall, its write and commit, and the requeue; 0: no "
             "warning")
    rate_limit: ByteSize = setting(
        ByteSize(0), min=0, help="upload bandwidth cap in bytes/s per node; 0: unlimited"
    )
    retry_initial_s: float = setting(1.0, min=0.01, max=60, help="first retry backoff")
    retry_max_s: float = setting(60.0, min=0.1, max=3600, help="longest retry backoff")
    request_timeout_s: float = setting(30.0, min=1, max=600, help="S3 connect/read timeout")
    upload_interval_s: float = setting(
        2.0, min=0.1, max=600, help="how often the agent looks for newly committed steps"
    )
    keep_local: int = setting(
        2, min=1, max=1000,
        help="committed steps kept on the node; older ones are deleted once verified in S3",
    )
    keep_remote: int = setting(
        0, min=0,
        help="committed steps kept in S3 per run, counted over the run's S3 listing (every "
             "job sharing the URI); 0: keep all")
    remote_retention_grace_s: float = setting(
        600.0, min=0, max=86400,
        help="an S3 step beyond keep_remote is deleted only this long after a newer step was "
             "committed, so a stage-in that chose it just before can still read it")
    local_only_keep_s: float = setting(
        86400.0, min=0, max=30 * 86400,
        help="how long the staging dir of an ended job without a run URI (its only copy) is "
             "kept for a requeue before the agent removes it")
    job_quota_fraction: float = setting(
        0.5, min=0.01, max=1.0,
        help="share of the staging disk one job's staging dir may use; the agent measures "
             "every job's dir each pass, and a job past it loses the grace of its local-only "
             "steps and is named in ckpt.status and the agent's log")
    eviction_grace_s: float = setting(
        600.0, min=0, max=86400,
        help="under space pressure, a local-only step of an ended job is evicted this long "
             "after the job ended (steps already in S3 go at once; a running job's newest "
             "step never goes); local_only_keep_s applies only while space lasts")
    eviction_free_target: ByteSize = setting(
        ByteSize(0), min=0,
        help="the agent evicts committed steps while the staging disk has less free than "
             "this; 0: health.nvme.min_free, so the health gate never drains for space "
             "that eviction can give back")
    remove_max_entries: int = setting(
        200_000, min=100,
        help="entries the agent removes from one staging dir per pass; the rest waits for "
             "the next pass")
    remove_max_s: float = setting(
        20.0, min=0.1, max=3600, help="time the agent spends removing one staging dir per pass")
    epilog_wait_s: float = setting(
        30.0, min=0, max=3600,
        help="how long the epilog waits for the job's pending uploads before handing them "
             "to the agent",
    )
    stagein_timeout_s: float = setting(
        600.0, min=1, max=86400, help="how long load_latest() waits for the agent's stage-in"
    )
    agent_unreachable: Literal["error", "local-only"] = setting(
        "error",
        help="a job with a run URI whose node agent can't be reached at start: error stops "
             "the job on every rank (its checkpoints on that node would never reach S3); "
             "local-only warns on every rank and keeps that node's checkpoints on the node")
    save_arrival_timeout_s: float = setting(
        30.0, min=1, max=3600,
        help="how long a save() waits for every rank to call it before failing on every "
             "rank that did, naming the ranks that did not (instead of hanging in the "
             "collective save); allow for the ranks' skew between training steps"
    )
    journal_dir: str = setting(
        "", help="durable upload journal; empty: <node.state_dir>/ckpt-journal; may contain {node}"
    )
    stagein_retry_s: float = setting(
        120.0, min=0, max=86400,
        help="how long stage-in retries transient S3 errors (5xx, throttling, timeouts, "
             "refused connections) before it fails with the cause; with buddy copies on, an "
             "endpoint that refuses the first connection or doesn't answer it is not retried "
             "first: the job's nodes are asked at once",
    )
    requeue_announce_wait_s: float = setting(
        30.0, min=0, max=3600,
        help="when this node's agent requeues a job away from a lost node, how long it keeps "
             "the job held while this node announces its newest committed step of the job "
             "in S3 (after an S3 outage uploads back off), so the requeued run waits for "
             "that step instead of resuming from an older one; 0: release at once",
    )
    stagein_intent_wait_s: float = setting(
        600.0, min=0, max=86400,
        help="how long stage-in waits for a step whose intent record is in S3 but whose "
             "COMMIT.json is not yet (still uploading from other nodes)",
    )
    stagein_intent_fallback: bool = setting(
        False, help="when that wait runs out, take the newest older step (logged as a "
                    "fallback) instead of failing the stage-in",
    )
    fetch_concurrency: int = setting(
        16, min=1, max=256, help="parallel ranged GETs per node for ckpt.fetch (all jobs)"
    )
    fetch_request_bytes: ByteSize = setting(
        ByteSize(8 * 1024**2), min=64 * 1024, max=256 * 1024**2,
        help="largest byte range one ckpt.fetch GET asks S3 for",
    )
    fetch_max_per_job: int = setting(
        8, min=1, max=256, help="ckpt.fetch requests one job may have in flight on a node; "
                                "more wait for a free slot",
    )
    buddy_copies: bool = setting(
        True,
        help="after each local commit, the agent sends this node's part of the newest step "
             "to its buddy (the next node of the job's sorted node list, in a ring) over the "
             "agents' munge-authenticated exchange, so that a node lost before its upload "
             "still has its part on another node; needs heartbeat.rendezvous other than none")
    buddy_rate: ByteSize = setting(
        ByteSize(64 * 1024**2), min=64 * 1024,
        help="bytes per second one node sends buddy copies at, at most (a one-second burst): "
             "keep it a small share of the NIC so the copy never slows the training; each "
             "node sends its own part once per checkpoint, so part size / interval must stay "
             "below it")
    buddy_quota_fraction: float = setting(
        0.25, min=0.01, max=1.0,
        help="share of the staging disk one job's buddy copies (and a restore's pulled "
             "parts) may use on a node; a copy that would pass it is refused and logged")
    buddy_wait_s: float = setting(
        30.0, min=1, max=3600,
        help="how long a restore waits for the job's other nodes to answer for their parts "
             "and buddy copies before it takes the nodes that did not answer as lost")
