"""Every rank arrives at a save before any collective starts, or every rank that came
fails within seconds naming the ranks that did not.

A ``save()`` called on some ranks only would otherwise block in its first collective
for the group's whole timeout (600 s) and end in a raw gloo error. The check goes
through the process group's key-value store, not a collective, so it works whatever
backend the training uses (gloo or NCCL) and leaves our gloo group in step either
way (nobody entered a collective). Its cost on the normal path is three store
requests per rank (``append``, ``add``, ``wait``), and three keys per save, which rank
0 deletes once everyone met at the next save (the store lives as long as the job).

The outcome is decided once, atomically, by ``add`` on one counter: the rank whose
arrival makes it reach the world size decides "all here"; a rank whose wait ran out
adds a large number instead, and the first such addition that finds the count short
decides "given up". The decider writes the outcome; everyone else reads it, so no
rank goes on into the collective while another gave up.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from slurm_resilience.checkpoint.errors import CheckpointError

GIVE_UP = 1 << 40  # added to the counter by a rank whose wait ran out
ALL_HERE = "all"
_OUTCOME_WAIT_S = 30.0  # the decider writes the outcome right after its add


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the check uses."""

    def set(self, key: str, value: str) -> None: ...
    def append(self, key: str, value: str) -> None: ...
    def delete_key(self, key: str) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """What the decider wrote: everyone arrived, or who had not when it gave up."""

    all_here: bool
    missing: tuple[int, ...] = ()

    def encode(self) -> str:
        return ALL_HERE if self.all_here else ",".join(map(str, self.missing))

    @staticmethod
    def decode(raw: bytes) -> Outcome:
        text = raw.decode()
        if text == ALL_HERE:
            return Outcome(True)
        return Outcome(False, tuple(int(r) for r in text.split(",") if r))


def ranks_text(ranks: tuple[int, ...], limit: int = 32) -> str:
    """``rank 3``, ``ranks 1, 3, 7`` (at most ``limit`` named, then how many more)."""
    shown = ", ".join(map(str, ranks[:limit]))
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}{more}"


class ArrivalCheck:
    """Meets the other ranks of a group at a named point, with a short deadline."""

    def __init__(self, store: Store, rank: int, world_size: int, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seen: dict[str, int] = {}  # how often this rank met at each point
        self._met: str | None = None  # the last meeting everyone came to (rank 0 deletes it)

    def meet(self, point: str, what: str) -> None:
        """Return once every rank reached ``point`` (e.g. ``save-5``); raise a
        CheckpointError naming the missing ranks, on every rank that came, otherwise.
        ``what`` names the call in the message (``save(5)``)."""
        if self.world_size <= 1:
            return
        n = self._seen.get(point, 0)
        self._seen[point] = n + 1
        key = f"{point}/{n}"  # a second save of the same step meets anew
        self.store.append(f"{key}/ranks", f"{self.rank},")
        count = self.store.add(f"{key}/count", 1)
        if count == self.world_size:
            self.store.set(f"{key}/outcome", ALL_HERE)
            self._forget_previous(key)
            return
        if count < self.world_size:
            try:
                self.store.wait([f"{key}/outcome"], datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError:  # the wait ran out (torch raises DistStoreError or plain)
                self._give_up(key)
        outcome = self._outcome(key)
        if outcome.all_here:
            self._forget_previous(key)
            return
        late = count > self.world_size
        message = (f"checkpoint: {what}: {ranks_text(outcome.missing)} of "
                   f"{self.world_size} did not call it within {self.timeout_s:g}s "
                   f"(checkpoint.save_arrival_timeout_s); every rank must call it, with "
                   "the same step; nothing was saved")
        if late:
            message += (f" (this rank, {self.rank}, arrived after the others gave up)")
        raise CheckpointError(message)

    def _give_up(self, key: str) -> None:
        total = self.store.add(f"{key}/count", GIVE_UP)
        if total >= 2 * GIVE_UP:
            return  # another rank gave up first and decides
        arrived = total - GIVE_UP
        if arrived == self.world_size:
            return  # the last rank came just before: it decided "all here"
        came = {int(r) for r in self.store.get(f"{key}/ranks").decode().split(",") if r}
        missing = tuple(r for r in range(self.world_size) if r not in came)
        self.store.set(f"{key}/outcome", Outcome(False, missing).encode())

    def _forget_previous(self, key: str) -> None:
        """Everyone came to ``key``, so everyone is done reading the previous meeting."""
        if self.rank == 0 and self._met is not None:
            for part in ("ranks", "count", "outcome"):
                self.store.delete_key(f"{self._met}/{part}")
        self._met = key

    def _outcome(self, key: str) -> Outcome:
        self.store.wait([f"{key}/outcome"], datetime.timedelta(seconds=_OUTCOME_WAIT_S))
        return Outcome.decode(self.store.get(f"{key}/outcome"))


def for_group(group: Any, rank: int, world_size: int, timeout_s: float,
              warn: Callable[[str], None]) -> ArrivalCheck | None:
    """The check over the default process group's store, under a prefix of ``group``'s
    own (unique per CheckpointManager, the same on every rank); None, with a warning,
    where this torch has no such store (saves then wait the group's timeout)."""
    import torch.distributed as dist

    try:
        base = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as exc:
        warn(f"checkpoint: couldn't reach the process group's store ({exc}); a save() "
             "that only some ranks call waits for the group's timeout")
        return None
    name = getattr(group, "group_name", "") or "default"
    store = dist.distributed_c10d.PrefixStore(f"slurm_resilience/ckpt/{name}/", base)
    # Store.append is in torch >= 2.2 (we need 2.5) but missing from its type stubs.
    return ArrivalCheck(cast(Store, store), rank, world_size, timeout_s)
