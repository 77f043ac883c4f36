"""``python -m slurm_resilience.hooks {prolog|epilog|healthcheck}``: what hooks/* exec.

The node's hook server runs the hook when it can (see ``hooks/client.py``); otherwise
this process loads everything and runs it itself, and its log says why.
"""

import os
import sys

from slurm_resilience.config import job_config_path
from slurm_resilience.config.paths import node_name
from slurm_resilience.hooks import client
from slurm_resilience.hooks.endpoint import KINDS

if len(sys.argv) < 2 or sys.argv[1] not in KINDS:
    print(f"usage: python -m slurm_resilience.hooks {{{'|'.join(KINDS)}}}", file=sys.stderr)
    sys.exit(2)
_kind, _argv, _env = sys.argv[1], sys.argv[2:], dict(os.environ)
_outcome = client.run(_kind, _argv, _env, job_config_path(_env), node_name("", _env))
if _outcome.rc is not None and _outcome.rc != client.LOST:
    sys.exit(_outcome.rc)

from slurm_resilience.hooks import runner  # noqa: E402 - only when the server did not run it

if _outcome.rc == client.LOST:
    sys.exit(runner.worker_lost(_kind, _env, _outcome.why))  # type: ignore[arg-type]
sys.exit(runner.main(_kind, _argv, in_process_because=_outcome.why))  # type: ignore[arg-type]
