"""``python -m slurm_resilience.hooks {prolog|epilog|healthcheck}``: what hooks/* exec."""

import sys

from slurm_resilience.hooks.runner import main

_KINDS = ("prolog", "epilog", "healthcheck")

if len(sys.argv) < 2 or sys.argv[1] not in _KINDS:
    print(f"usage: python -m slurm_resilience.hooks {{{'|'.join(_KINDS)}}}", file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[1], sys.argv[2:]))  # type: ignore[arg-type]
