"""Hang observations exchanged between a job's agents over the network (no shared
filesystem): munge-authenticated TCP with a bounded fan-in tree rooted at the batch host.

``NetworkRendezvous`` implements the hang watcher's ``Rendezvous`` protocol.
"""

from slurm_resilience.heartbeat.exchange.rendezvous import NetworkRendezvous, from_config

__all__ = ["NetworkRendezvous", "from_config"]
