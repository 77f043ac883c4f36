"""The agent's service that keeps this node's hook server running (``hooks.server:
agent``, for nodes without systemd, such as the sandbox's; sites run the server as
its own unit, ``slurm-resilience-hooks.service``, outside the agent's private mounts).

It starts ``python -I -m slurm_resilience.hooks.server`` with the agent's configuration
file and node name, starts it again when it exits (after 1, 2, 4 ... 60 s, so a server
that can't listen doesn't spin), and stops it with the agent. The server stops by itself
when the agent is gone, so a SIGKILLed agent leaves no server behind.
"""

from __future__ import annotations

import sys

from slurm_resilience import config, proc
from slurm_resilience.agent.service import AgentContext, Handler
from slurm_resilience.clock import Clock, SystemClock
from slurm_resilience.log import get_logger

log = get_logger("agent", service="hook-server")

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
STOP_GRACE_S = 5.0


class HookServerService:
    name = "hook-server"
    interval_s = 1.0

    def __init__(self, argv: list[str], clock: Clock = SystemClock()):
        self.argv = argv
        self.proc: proc.Child[bytes] | None = None
        self.backoff = BACKOFF_MIN_S
        self.next_start = 0.0
        self.started_at = 0.0
        self.starts = 0
        self._clock = clock

    def start(self) -> None:
        self.proc = proc.spawn(self.argv, stdout=None, stderr=None, new_session=False)
        self.starts += 1
        self.started_at = self._clock.monotonic()
        log.info("hook server started", pid=self.proc.pid, starts=self.starts)

    def tick(self) -> None:
        now = self._clock.monotonic()
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                if now - self.started_at > BACKOFF_MAX_S:
                    self.backoff = BACKOFF_MIN_S  # it ran a while: the next exit starts over
                return
            log.warning("hook server exited; hooks run in their own processes until it is "
                        "back", code=code, restart_in_s=self.backoff)
            self.proc = None
            self.next_start = now + self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
        if now >= self.next_start:
            self.start()

    def handlers(self) -> dict[str, Handler]:
        return {}

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_GRACE_S)
        except proc.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def factory(ctx: AgentContext) -> HookServerService | None:
    if ctx.cfg.hooks.server != "agent":
        return None
    path, _ = config.resolve_path()
    svc = HookServerService([sys.executable, "-I", "-m", "slurm_resilience.hooks.server",
                             "--config", path, "--node", ctx.node])
    svc.start()
    return svc
