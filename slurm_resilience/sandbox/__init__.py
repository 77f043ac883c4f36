"""A real Slurm cluster on one machine, for tests, the demo and admins trying the hooks.

``slurm-resilience sandbox up [--nodes N] [--leaves L] [--state-dir DIR] [--port-base P]``
starts, from Debian's packages (installed with apt-get when missing):

- its own ``munged`` on a socket inside the state directory;
- ``slurmctld`` on ``127.0.0.1:P`` and one ``slurmd -N nodeX`` per node on ports
  P+1…P+N (Slurm's multiple-slurmd mode), with ``Prolog``, ``Epilog``,
  ``HealthCheckProgram`` and (when present) ``job_submit.lua`` wired to this
  checkout's ``hooks/``, nodes split across L leaf switches in
  ``topology.conf`` with a ``leafNN`` feature each;
- ``rclone serve s3`` on ``127.0.0.1:P+99`` with a bucket ``ckpt``;
- one node agent per node, once the agent exists.

Everything lives in the state directory (default ``<repo>/.sandbox``):
``etc/`` (slurm.conf, topology.conf, slurm-resilience.yaml, the hooks' config),
``log/``, ``run/`` (pid files), ``nodes/<node>/`` (per-node directories;
``nvme/`` stands in for local NVMe), ``s3/``. ``sandbox env`` prints the
``export`` lines to use it; ``sandbox down`` cancels its jobs and stops its
processes: the daemons of its pid files, then whatever they started (slurmstepd,
jobs, idle verifiers), recognised by paths inside the state dir or its marker
variable, never another sandbox's. Sandboxes with different state dirs and port
bases run side by side.
"""
