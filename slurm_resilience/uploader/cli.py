"""``slurm-resilience ckpt ls|verify|pull URI``: look at a run's checkpoints in S3;
``ckpt status JOB_ID``: a job's stage-in and uploads, from the node's agent."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurm_resilience import config
from slurm_resilience.checkpoint.commit import CheckpointError, step_name


def register(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="list, verify or download a run's checkpoints in S3")
    csub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ls = csub.add_parser("ls", help="list complete steps (COMMIT.json present) and their size")
    ls.add_argument("uri", help="the run URI, s3://BUCKET/PREFIX")
    ls.set_defaults(func=_guarded(run_ls))
    ver = csub.add_parser("verify", help="download and check every file of a step "
                                         "(default: the newest) against its manifest")
    ver.add_argument("uri", help="the run URI, s3://BUCKET/PREFIX")
    ver.add_argument("--step", type=int, default=None,
                     help="the step to verify (default: the newest complete step)")
    ver.add_argument("--all", action="store_true", help="verify every complete step")
    ver.set_defaults(func=_guarded(run_verify))
    pull = csub.add_parser("pull", help="download the newest verified step into a directory")
    pull.add_argument("uri", help="the run URI, s3://BUCKET/PREFIX")
    pull.add_argument("dest", help="the directory to download the step into "
                      "(its step-NNNNNNNN directory is created there)")
    pull.add_argument("--step", type=int, default=None,
                      help="the step to download (default: the newest verified step)")
    pull.set_defaults(func=_guarded(run_pull))
    st = csub.add_parser("status", help="a job's stage-in (step, source, fallbacks, error), "
                                        "fetches, where the restore's parts came from, buddy "
                                        "copies and pending uploads, from this node's agent")
    st.add_argument("job_id", type=int, help="the Slurm job id")
    st.add_argument("--node", default="", help="node whose agent to ask (default: this node)")
    st.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    st.set_defaults(func=_guarded(run_status))


def _guarded(fn: Any) -> Any:
    """Print checkpoint errors as one line (exit 2) instead of a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except CheckpointError as exc:
            print(exc, file=sys.stderr)
            return 2

    return run


def _client(args: argparse.Namespace) -> Any:
    from slurm_resilience.uploader.s3 import S3
    from slurm_resilience.uploader.service import s3_settings

    settings = s3_settings(config.load(args.config))
    if settings.credentials_file and not os.access(settings.credentials_file, os.R_OK):
        settings = replace(settings, credentials_file="")  # users bring their own credentials
    return S3(replace(settings, attempts=2))


def _uri(text: str) -> Any:
    from slurm_resilience.checkpoint.prefix import parse_uri

    return parse_uri(text)


def run_ls(args: argparse.Namespace) -> int:
    from slurm_resilience.uploader.stagein import remote_steps

    uri = _uri(args.uri)
    steps = remote_steps(_client(args), uri)
    if not steps:
        print(f"{uri}: no complete step")
        return 1
    for step in sorted(steps):
        objs = steps[step]
        print(f"{step_name(step)}  {sum(objs.values()):>14,d} bytes  {len(objs)} objects")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from slurm_resilience.progress import ByteBar
    from slurm_resilience.uploader.pullverify import verify_remote
    from slurm_resilience.uploader.stagein import remote_steps

    uri = _uri(args.uri)
    s3 = _client(args)
    steps = sorted(remote_steps(s3, uri))
    if args.step is not None:
        steps = [s for s in steps if s == args.step]
    elif not args.all:
        steps = steps[-1:]
    if not steps:
        print(f"{uri}: no complete step to verify")
        return 1
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as scratch:
        for step in steps:
            try:
                problems = verify_remote(s3, uri, step, Path(scratch), ByteBar)
            except CheckpointError as exc:
                problems = [str(exc)]
            if problems:
                failed += 1
                print(f"{step_name(step)}: FAILED")
                for p in problems:
                    print(f"  {p}")
            else:
                print(f"{step_name(step)}: ok")
    return 1 if failed else 0


def run_pull(args: argparse.Namespace) -> int:
    from slurm_resilience.progress import ByteBar
    from slurm_resilience.uploader.pullverify import pull

    step = pull(_client(args), _uri(args.uri), Path(args.dest), args.step, ByteBar)
    print(f"{step_name(step)} -> {Path(args.dest) / step_name(step)}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    import json

    from slurm_resilience.agent.client import AgentRefused, AgentUnavailable, call
    from slurm_resilience.config.paths import node_name, node_path

    cfg = config.load(args.config)
    node = node_name(args.node or cfg.node.name)
    try:
        answer = call(node_path(cfg.agent.socket, node), "ckpt.status", job_id=args.job_id,
                      timeout=cfg.agent.request_timeout_s)
    except AgentRefused as exc:
        raise CheckpointError(f"checkpoint: status: couldn't ask the agent on {node}: {exc}"
                              ) from None
    except AgentUnavailable as exc:
        raise CheckpointError(
            f"checkpoint: status: the agent on {node} can't be reached ({exc}): job "
            f"{args.job_id}'s checkpoints on {node} are not uploaded to S3 and nothing is "
            "staged in there until it returns") from None
    if args.json:
        print(json.dumps(answer, indent=1, sort_keys=True))
    else:
        print("\n".join(format_status(args.job_id, node, answer)))
        print(f"  time lost to restarts and stage-in: slurm-resilience goodput {args.job_id} "
              f"--node {node}")
    return 1 if answer.get("stagein") == "failed" else 0


def format_status(job_id: int, node: str, answer: dict[str, Any]) -> list[str]:
    """Human lines for a ``ckpt.status`` answer; fallbacks and errors are never left out."""
    state = answer.get("stagein")
    head = f"job {job_id} on {node}: stage-in {state}"
    if state == "done":
        step = answer.get("step")
        head += (": no committed step in the run" if step is None else
                 f": step {step} from {answer.get('source')} ({answer.get('mode')})")
    elif state == "failed":
        head += f": {answer.get('error')}"
    lines = [head]
    for fb in answer.get("fallbacks") or []:
        if fb.get("opt_in"):
            lines.append(f"  WARNING: took OLDER step {answer.get('step')} instead of step "
                         f"{fb.get('step')} because {fb.get('opt_in')} is set")
        lines.append(f"  passed over step {fb.get('step')}: {fb.get('reason')}")
    fetch = answer.get("fetch") or {}
    if fetch.get("requests"):
        lines.append(f"  fetched {fetch.get('fetched_bytes', 0):,d} bytes in "
                     f"{fetch.get('fetched_blocks', 0)} blocks; "
                     f"{fetch.get('local_blocks', 0)} blocks verified in place")
    buddy = answer.get("buddy") or {}
    if buddy.get("parts"):
        lines.append(f"  parts of the restore: {buddy['parts']}")
    sent = buddy.get("sent") or {}
    if sent:
        lines.append(f"  buddy copy: step {sent.get('step')} sent to {sent.get('to') or '?'}"
                     + (f" FAILED: {sent['error']}" if sent.get("error") else ""))
    for source, step in sorted((buddy.get("held") or {}).items()):
        lines.append(f"  buddy copy held here: step {step} of {source}")
    if buddy.get("held_error"):
        lines.append(f"  ERROR: buddy area: {buddy['held_error']}")
    if answer.get("pending"):
        lines.append(f"  uploads pending: steps {answer['pending']}")
    lost = answer.get("unreachable_nodes") or []
    if lost:
        lines.append(f"  WARNING: the job's ranks couldn't reach the agent on {', '.join(lost)}: "
                     "checkpoints saved there stay there, so no step commits in S3 until it "
                     "returns")
    return lines
