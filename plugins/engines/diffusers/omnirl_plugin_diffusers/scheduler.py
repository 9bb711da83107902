"""Which requests run together: admission into the active set and the batch of each denoising step.

Plain Python (no torch): the engine owns the tensors, the scheduler only sees ``Slot`` objects.

- ``StepScheduler`` (mode ``step``): step-wise continuous batching. Requests of one bucket (same latent
  shape and CFG scale: they can share one ``velocity`` call) form that bucket's batch; every step one bucket
  runs, the one least recently run (round robin, so no shape blocks another); a request that finishes
  frees its slot at once and a waiting request of that bucket takes it at the next step.
- ``StaticScheduler`` (modes ``request`` and ``single``): request-level batching. A batch is formed from
  the requests that have arrived, runs until its longest request is done (finished requests stay in the
  batch as padding rows: static tensors), and is returned as a whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from omnirl_core.contracts import GenRequest


@dataclass(eq=False)
class Slot:
    """One request inside the engine, waiting or active."""

    request: GenRequest
    key: Hashable
    """Bucket: requests with equal keys can share one model call."""
    nbytes: int
    """Device memory its latents hold while active."""
    num_steps: int
    arrival: float
    """Clock time at which it may be admitted."""
    order: int = 0
    """Submission order, breaks arrival ties."""
    step: int = 0
    admitted: float | None = None
    state: Any = field(default=None, repr=False)
    """Engine-owned tensors (latents, trajectory, generator)."""

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps


@dataclass
class Batch:
    """One model call: ``rows`` advance one step; ``padding`` rows are computed and discarded."""

    key: Hashable
    rows: list[Slot]
    padding: list[Slot] = field(default_factory=list)

    @property
    def slots(self) -> list[Slot]:
        return self.rows + self.padding


class Scheduler:
    """Shared bookkeeping: the waiting list (arrival order) and the active set."""

    def __init__(self, max_num_seqs: int, max_latent_bytes: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.max_latent_bytes = max_latent_bytes
        self.waiting: list[Slot] = []
        self.active: list[Slot] = []
        self._orders = 0

    def add(self, slot: Slot) -> None:
        if self.max_latent_bytes is not None and slot.nbytes > self.max_latent_bytes:
            raise ValueError(
                f"request {slot.request.uid} needs {slot.nbytes} bytes of latents, more than the "
                f"{self.max_latent_bytes} the engine may hold"
            )
        slot.order = self._orders
        self._orders += 1
        self.waiting.append(slot)
        self.waiting.sort(key=lambda s: (s.arrival, s.order))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def next_arrival(self, now: float) -> float | None:
        """The earliest arrival still in the future (None if every waiting request has arrived)."""
        future = [s.arrival for s in self.waiting if s.arrival > now]
        return min(future) if future else None

    def active_bytes(self) -> int:
        return sum(s.nbytes for s in self.active)

    def _fits(self, used: int, slot: Slot) -> bool:
        return self.max_latent_bytes is None or used + slot.nbytes <= self.max_latent_bytes

    def _take(self, slots: list[Slot], now: float) -> list[Slot]:
        taken = set(map(id, slots))
        self.waiting = [s for s in self.waiting if id(s) not in taken]
        for s in slots:
            s.admitted = now
        self.active.extend(slots)
        return slots

    def admit(self, now: float) -> list[Slot]:
        raise NotImplementedError

    def next_batch(self) -> Batch | None:
        raise NotImplementedError

    def finish(self, batch: Batch) -> list[Slot]:
        """After ``batch`` ran: the slots to return now (they leave the active set)."""
        raise NotImplementedError


class StepScheduler(Scheduler):
    """Step-wise continuous batching, round robin across buckets.

    Admission walks the arrived requests in arrival order: a request whose bucket already holds
    ``max_num_seqs`` active requests is skipped (it does not block other buckets); when the latent memory
    cap is reached admission stops (first come, first served, so a large request is not starved).
    """

    def __init__(self, max_num_seqs: int, max_latent_bytes: int | None = None):
        super().__init__(max_num_seqs, max_latent_bytes)
        self._tick = 0
        self._last_run: dict[Hashable, int] = {}

    def admit(self, now: float) -> list[Slot]:
        counts: dict[Hashable, int] = {}
        for s in self.active:
            counts[s.key] = counts.get(s.key, 0) + 1
        used = self.active_bytes()
        chosen = []
        for slot in self.waiting:
            if slot.arrival > now:
                break
            if counts.get(slot.key, 0) >= self.max_num_seqs:
                continue
            if not self._fits(used, slot):
                break
            chosen.append(slot)
            counts[slot.key] = counts.get(slot.key, 0) + 1
            used += slot.nbytes
        return self._take(chosen, now)

    def next_batch(self) -> Batch | None:
        buckets: dict[Hashable, list[Slot]] = {}
        for s in self.active:
            buckets.setdefault(s.key, []).append(s)
        if not buckets:
            return None
        # least recently run bucket first; among never-run buckets the one whose oldest request came first
        key = min(buckets, key=lambda k: (self._last_run.get(k, -1), min((s.arrival, s.order) for s in buckets[k])))
        self._tick += 1
        self._last_run[key] = self._tick
        return Batch(key, buckets[key])

    def finish(self, batch: Batch) -> list[Slot]:
        done = [s for s in batch.rows if s.done]
        if done:
            finished = set(map(id, done))
            self.active = [s for s in self.active if id(s) not in finished]
        return done


class StaticScheduler(Scheduler):
    """Request-level (static) batching: the first arrived request picks the bucket, the batch is filled
    with arrived requests of that bucket (up to ``max_num_seqs`` and the memory cap) and runs until all
    are done. ``max_num_seqs=1`` is one request at a time."""

    def admit(self, now: float) -> list[Slot]:
        if self.active:
            return []
        arrived = [s for s in self.waiting if s.arrival <= now]
        if not arrived:
            return []
        key = arrived[0].key
        chosen: list[Slot] = []
        used = 0
        for slot in arrived:
            if len(chosen) == self.max_num_seqs:
                break
            if slot.key != key:
                continue
            if not self._fits(used, slot):
                break
            chosen.append(slot)
            used += slot.nbytes
        return self._take(chosen, now)

    def next_batch(self) -> Batch | None:
        if not self.active:
            return None
        return Batch(self.active[0].key, [s for s in self.active if not s.done], [s for s in self.active if s.done])

    def finish(self, batch: Batch) -> list[Slot]:
        if all(s.done for s in self.active):
            done, self.active = self.active, []
            return done
        return []
