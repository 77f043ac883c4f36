"""The buddy sender's bandwidth bound: a token bucket on an injected clock.

Buddy copies share the NIC with the training's collectives, so the sender never goes
faster than ``checkpoint.buddy_rate`` bytes a second, averaged over a burst of at most
one second's worth (or one chunk, whichever is larger). The clock is injected: tests step
it by hand and never sleep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slurm_resilience.clock import Clock, SystemClock


@dataclass
class RateLimiter:
    """``wait(n)`` before sending ``n`` bytes; ``rate`` 0 means unlimited."""

    rate: int
    clock: Clock = field(default_factory=SystemClock)
    burst: int = 0  # 0: one second's worth
    _tokens: float = 0.0
    _at: float | None = None
    waited_s: float = 0.0  # total time spent waiting (for the log and the tests)

    def delay(self, nbytes: int) -> float:
        """How long to wait before ``nbytes`` may go, taking them from the bucket."""
        if self.rate <= 0:
            return 0.0
        now = self.clock.monotonic()
        cap = float(max(self.burst or self.rate, nbytes))
        if self._at is None:
            self._tokens = cap
        else:
            self._tokens = min(cap, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self.rate

    def wait(self, nbytes: int) -> float:
        """Sleep (on the clock) until ``nbytes`` may go; returns the time slept."""
        pause = self.delay(nbytes)
        if pause > 0:
            self.clock.sleep(pause)
            self.waited_s += pause
        return pause
