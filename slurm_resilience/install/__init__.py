"""``slurm-resilience install``: put the files a node or controller needs into place.

The wheel carries the hook wrappers, ``job_submit.lua``, the SPANK source, the
systemd unit and the example configuration (:mod:`.assets` finds them); the
installer copies them where Slurm and systemd look, idempotently, and says what
it changed, so a node needs the wheel and nothing of the repository.
"""
