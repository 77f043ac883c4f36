import sys

from slurm_resilience.cli import main

sys.exit(main())
