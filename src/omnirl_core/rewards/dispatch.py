"""Reward dispatch: several rewards combined as a weighted sum, each required or optional.

Every call has a deadline (``run.reward_timeout_s``) and runs on a daemon thread, so a hung reward neither
hangs the run nor keeps Ctrl-C from stopping it. A score must be a finite real number (not a bool, not a
string). A failing required reward fails the step with its error. A failing optional reward is dropped for
the whole group of every sample it failed on (group-mates are compared on the same rewards, so the
advantages stay unbiased), counted in ``reward/<name>/dropped_frac``; an optional reward that fails on
every group for ``run.reward_max_failed_steps`` steps in a row stops the run, as does a step in which no
group has any reward left.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from omnirl_core.contracts import Reward, Sample, as_reward
from omnirl_core.errors import OmnirlError

if TYPE_CHECKING:
    import queue

    from omnirl_core.config import RewardEntry

T = TypeVar("T")

log = logging.getLogger("omnirl.rewards")


@dataclass
class RewardFn:
    """One reward of a run: its name, the ``Reward`` (a plain callable is wrapped with every default), its weight
    in the sum, and whether a failure stops the run."""

    name: str
    fn: Reward
    weight: float = 1.0
    required: bool = True

    def __post_init__(self) -> None:
        self.fn = as_reward(self.fn)


class RewardError(OmnirlError):
    pass


class RewardTimeout(RuntimeError):
    pass


class DeadlineThreads:
    """Daemon threads for ``call_with_deadline``, reused from call to call: starting a thread for each call cost
    0.25 ms, about all of a cheap reward's time (32 one-sample calls of a colour reward: 10 ms against 2 ms). A
    call takes an idle thread or starts one; a thread left behind by a call past its deadline rejoins the idle
    ones when that call returns; a thread idle for ``idle_s`` ends."""

    def __init__(self, idle_s: float = 30.0):
        self.idle_s = idle_s
        self._idle: list[Any] = []  # the inboxes (queue.SimpleQueue) of the idle threads, last idle first
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> Future:
        import queue

        future: Future = Future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), daemon=True, name="omnirl-reward-call").start()
        inbox.put((fn, future))
        return future

    def _work(self, inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        import queue

        while True:
            try:
                fn, future = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # else a call has just taken this thread: its job is on the way
                        self._idle.remove(inbox)
                        return
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)
            del fn, future  # nothing of the call stays alive while the thread idles
            with self._lock:
                self._idle.append(inbox)


    def _forget(self) -> None:
        """In a forked child: the parent's idle threads do not exist there, so their inboxes must not be used."""
        self._idle = []
        self._lock = threading.Lock()


_DEADLINE_THREADS = DeadlineThreads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_DEADLINE_THREADS._forget)


def call_with_deadline(fn: Callable[[], T], timeout_s: float | None) -> T:
    """``fn()`` on a daemon thread (``DeadlineThreads``); past ``timeout_s`` it is abandoned (a thread cannot be
    killed: it is left to finish in the background, and never keeps the process alive) and RewardTimeout is
    raised."""
    if timeout_s is None:
        return fn()
    try:
        return _DEADLINE_THREADS.submit(fn).result(timeout=timeout_s)
    except TimeoutError:
        raise RewardTimeout(f"no answer within {timeout_s:g} s (run.reward_timeout_s)") from None


def check_scores(values: object, count: int) -> list[float]:
    """A reward's answer as floats: one finite real number per sample, or an error that says what is wrong."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"returned a {type(values).__name__}; expected a list of {count} numbers")
    values = list(values)
    if len(values) != count:
        raise ValueError(f"returned {len(values)} scores for {count} samples")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value).__name__ == "bool_":
            raise TypeError(f"returned {value!r} ({type(value).__name__}); a score must be a real number "
                            "(int or float, not bool or str)")
        if not math.isfinite(float(value)):
            raise ValueError(f"returned a non-finite score {value!r}")
        out.append(float(value))
    return out


class RewardSet:
    def __init__(self, rewards: list[RewardFn], timeout_s: float | None = None):
        if not rewards:
            raise ValueError("at least one reward is needed")
        self.rewards = rewards
        self.timeout_s = timeout_s
        self.time_s = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _arguments(reward: RewardFn, samples: list[Sample]) -> tuple[list[Any], list[str], dict[str, Any]]:
        """What a reward is called with: outputs, prompts, and each prompt's record for one that compares
        against it (``uses_inputs``)."""
        kwargs = {"inputs": [s.request.inputs for s in samples]} if reward.fn.uses_inputs else {}
        return [s.output for s in samples], [s.prompt for s in samples], kwargs

    def _call(self, reward: RewardFn, samples: list[Sample]) -> list[float]:
        outputs, prompts, kwargs = self._arguments(reward, samples)
        return call_with_deadline(lambda: reward.fn(outputs, prompts, **kwargs), self.timeout_s)

    def score(self, samples: list[Sample]) -> None:
        """Fill ``sample.rewards`` and ``sample.reward`` in place. An optional reward that fails leaves its
        name out of these samples' ``rewards`` (``RewardHealth.settle`` then drops it for their groups)."""
        if not samples:
            return
        start = time.perf_counter()
        for reward in self.rewards:
            values: list[float] | Exception
            try:
                values = self._call(reward, samples)
            except Exception as exc:  # noqa: BLE001 - judged by _record
                values = exc
            self._record(reward, samples, values)
        total(samples, self.rewards)
        with self._lock:  # reward threads score concurrently
            self.time_s += time.perf_counter() - start

    @property
    def batch_invariant(self) -> bool:
        """Every reward scores each sample on its own (its ``batch_invariant = True``: a sample's score is the same
        whatever else shares its call), so batching the samples that pile up changes no score: the executors then
        batch them whatever ``run.reward_batching`` says (a call per sample costs a cheap reward more than its
        scoring: on Ray, about 2.5 ms of CPU per call beside the rollout)."""
        return all(r.fn.batch_invariant for r in self.rewards)

    @property
    def submittable(self) -> bool:
        """Every reward scores on its own threads or event loop (``asynchronous``: ``submit``, see ``ascore``)."""
        return all(r.fn.asynchronous for r in self.rewards)

    @property
    def batch_capacity(self) -> int:
        """How many samples one call should carry so that none waits inside the rewards: 0 unless every reward
        has ``submit``; then the smallest ``capacity`` they declare (the samples a reward judges at once, e.g. the
        VLM judge's requests in flight), 1 for one that declares none."""
        if not self.submittable:
            return 0
        return max(1, min(int(r.fn.capacity) for r in self.rewards))

    async def ascore(self, samples: list[Sample]) -> None:
        """``score`` for an event loop (a Ray async reward actor): an ``asynchronous`` reward's ``submit(outputs,
        prompts[, inputs=])``, which starts the scoring on the reward's own threads or loop and returns a
        ``concurrent.futures.Future``, is awaited without a thread of this loop's; any other reward runs on a
        thread of the loop's executor. The same deadline, checks and failure handling as ``score``."""
        import asyncio

        if not samples:
            return
        start = time.perf_counter()
        for reward in self.rewards:
            values: list[float] | Exception
            try:
                if reward.fn.asynchronous:
                    outputs, prompts, kwargs = self._arguments(reward, samples)
                    future = asyncio.wrap_future(reward.fn.submit(outputs, prompts, **kwargs))
                    try:
                        values = await asyncio.wait_for(future, self.timeout_s)
                    except asyncio.TimeoutError:
                        raise RewardTimeout(f"no answer within {self.timeout_s:g} s (run.reward_timeout_s)") \
                            from None
                else:
                    values = await asyncio.to_thread(self._call, reward, samples)
            except Exception as exc:  # noqa: BLE001 - judged by _record
                values = exc
            self._record(reward, samples, values)
        total(samples, self.rewards)
        self.time_s += time.perf_counter() - start  # one event loop: no concurrent update

    def _record(self, reward: RewardFn, samples: list[Sample], values: object) -> None:
        """A reward's answer (or the exception it raised) into the samples: checked scores, or the failure
        handling of a required (raise) or optional (warn, leave it out) reward."""
        try:
            if isinstance(values, BaseException):
                raise values
            scores = check_scores(values, len(samples))
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if reward.required:
                raise RewardError(
                    f"Required reward '{reward.name}' failed on {len(samples)} sample(s): {message}",
                    hint="Fix the reward, or mark it optional (rewards[].required=false) to drop it for "
                    "the groups it fails on.",
                ) from exc
            log.warning("optional reward %s failed on %d sample(s), dropped for their groups: %s",
                        reward.name, len(samples), message)
            return
        for sample, value in zip(samples, scores):
            sample.rewards[reward.name] = value


def total(samples: list[Sample], rewards: Sequence[RewardFn] | Sequence[RewardEntry]) -> None:
    """Each sample's reward: the weighted sum of the rewards it has."""
    for sample in samples:
        sample.reward = sum(r.weight * sample.rewards[r.name] for r in rewards if r.name in sample.rewards)


class RewardHealth:
    """After a step's scoring (in the controller, whatever executor scored): optional rewards dropped group
    by group where they failed, the drop fractions as metrics, and a stop when rewards keep failing."""

    def __init__(self, max_failed_steps: int):
        self.max_failed_steps = max_failed_steps
        self.streaks: dict[str, int] = {}

    def state(self) -> dict[str, Any]:
        return {"failed_streaks": dict(self.streaks)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.streaks = dict(state.get("failed_streaks", {}))

    def settle(self, samples: list[Sample], entries: Sequence[RewardEntry], step: int) -> dict[str, float]:
        groups: dict[int, list[Sample]] = {}
        for sample in samples:
            groups.setdefault(sample.request.group, []).append(sample)
        metrics: dict[str, float] = {}
        for entry in entries:
            failed = [g for g in groups.values() if any(entry.name not in s.rewards for s in g)]
            for group in failed:
                for sample in group:
                    sample.rewards.pop(entry.name, None)
            if entry.required:
                continue
            metrics[f"reward/{entry.name}/dropped_frac"] = len(failed) / max(len(groups), 1)
            self.streaks[entry.name] = self.streaks.get(entry.name, 0) + 1 if len(failed) == len(groups) else 0
            if self.streaks[entry.name] >= self.max_failed_steps:
                raise RewardError(
                    f"Optional reward '{entry.name}' failed on every sample for {self.streaks[entry.name]} steps "
                    f"in a row (step {step}): the run would train without it.",
                    details=["Its errors are in the warnings above."],
                    hint="Fix the reward (or its server), or remove it from the run; "
                    "run.reward_max_failed_steps sets the patience.",
                )
        total(samples, entries)
        empty = [g for g in groups.values() if not g[0].rewards]
        if empty and len(empty) == len(groups):
            raise RewardError(f"No reward could be computed for any sample at step {step}: every reward of the "
                              "run failed (see the warnings above).", hint="Fix the rewards, or their servers.")
        metrics["reward/groups_without_reward_frac"] = len(empty) / max(len(groups), 1)
        return metrics


@dataclass
class RewardTiming:
    rollout_s: float = 0.0
    """From the start of the rollout to its last finished sample."""
    wait_s: float = 0.0
    """Reward time left after the rollout's end (sync: all of it; async: the tail)."""
    busy_s: float = 0.0
    """Reward compute summed over workers."""
    calls: int = 0
    """Reward calls made (each scores a batch of samples)."""

    def metrics(self) -> dict[str, float]:
        return {"time/rollout_s": self.rollout_s, "time/reward_s": self.wait_s, "time/reward_busy_s": self.busy_s,
                "time/reward_calls": float(self.calls)}


class RewardPool:
    """Daemon worker threads (a ThreadPoolExecutor's threads are joined at exit, so one hung reward would
    keep the process from ever ending, Ctrl-C included)."""

    def __init__(self, workers: int, name: str = "omnirl-reward"):
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"{name}-{n}") for n in range(workers)]
        for thread in self._threads:
            thread.start()
        self.workers = workers

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    future.set_exception(exc)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers: idle ones end at once and are joined (no thread of ours is left running when the
        interpreter shuts down); one stuck in a reward past its deadline is left behind (it is a daemon)."""
        for _ in range(self.workers):
            self._jobs.put(None)
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))


class RewardStream:
    """Scores a stream of finished samples on a pool of threads.

    ``async``: samples are scored while the rest of the rollout runs, one call each. With ``batch_async`` a
    reward thread that is free takes the samples that have finished and wait (its fair share of them: the
    pending count over the threads, at least one), so an idle pool scores each sample the moment it comes, and a
    busy one scores what piled up in one batched call (a learned reward's batched forward costs far less per
    image); which samples share a call then depends on timing.
    ``sync``: the whole batch is scored after the rollout (split over the threads). Either way the caller gets
    every sample back scored: the update waits for the whole batch. Threads suffice here: rewards spend their
    time in native code or I/O that releases the GIL.
    """

    def __init__(self, rewards: RewardSet, workers: int = 2, mode: str = "async", batch_async: bool = False):
        if mode not in ("async", "sync"):
            raise ValueError(f"reward mode must be 'async' or 'sync', got {mode!r}")
        self.batch_async = batch_async
        """Async: batch what piles up (``run.reward_batching``); False: one call per sample, so that which samples
        share a call never depends on timing."""
        self.rewards = rewards
        self.workers = workers
        self.mode = mode
        self.pool = RewardPool(workers)
        self.batches: list[int] = []
        """Sizes of the last run's reward calls."""

    def _timed_score(self, samples: list[Sample]) -> float:
        start = time.perf_counter()
        if samples:
            self.batches.append(len(samples))
            self.rewards.score(samples)
        return time.perf_counter() - start

    def _score_pending(self, pending: deque, lock: threading.Lock) -> float:
        with lock:
            share = max(1, -(-len(pending) // self.workers))
            batch = [pending.popleft() for _ in range(min(share, len(pending)))]
        return self._timed_score(batch)

    def run(self, stream: Iterable[Sample]) -> tuple[list[Sample], RewardTiming]:
        """Drain ``stream`` (an iterator of finished samples); returns (samples, timing)."""
        start = time.perf_counter()
        samples: list[Sample] = []
        futures = []
        pending: deque = deque()
        lock = threading.Lock()
        self.batches = []
        for sample in stream:
            samples.append(sample)
            if self.mode == "async":
                if self.batch_async:
                    with lock:
                        pending.append(sample)
                    # one job per sample: a job finds its sample already taken by a busier batch, or takes a share
                    futures.append(self.pool.submit(self._score_pending, pending, lock))
                else:
                    futures.append(self.pool.submit(self._timed_score, [sample]))
        rollout_end = time.perf_counter()
        if self.mode == "sync":
            size = -(-len(samples) // self.workers) if samples else 1
            futures = [self.pool.submit(self._timed_score, samples[i:i + size])
                       for i in range(0, len(samples), size)]
        try:
            results = [f.result() for f in futures]  # each call has its deadline (RewardSet)
        finally:
            for f in futures:
                f.cancel()  # a failed step leaves no queued work behind
        timing = RewardTiming(rollout_end - start, time.perf_counter() - rollout_end, sum(results), len(self.batches))
        return samples, timing

    def close(self) -> None:
        self.pool.close()
