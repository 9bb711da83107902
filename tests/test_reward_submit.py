"""``RewardSet.ascore``, what the Ray reward actor (an async actor) runs: a reward with ``submit`` is awaited on
the event loop, any other reward runs on a thread of the loop's executor; the same scores, deadline and failure
handling as ``score``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

import pytest

from omnirl_core.contracts import GenRequest, Reward, RolloutPlan, Sample
from omnirl_core.rewards.dispatch import RewardError, RewardFn, RewardSet

PLAN = RolloutPlan(step_kinds=("ode",), train_steps=())


def _samples(n: int) -> list[Sample]:
    return [Sample(request=GenRequest(uid=i, prompt=f"p{i}", prompt_index=i, group=i, seed=i, height=8, width=8,
                                      plan=PLAN, inputs={"target": 10.0 * i}),
                   latents=None, sigmas=None, logprobs=None, output=float(i)) for i in range(n)]


class Submitted(Reward):
    """Scores on its own thread pool; ``submit`` returns at once (as the VLM judge does)."""

    asynchronous = True

    def __init__(self, release: threading.Event | None = None, answer=None):
        self.pool = concurrent.futures.ThreadPoolExecutor(2)
        self.release = release
        self.answer = answer
        self.submitted = 0
        self.submit_threads: list[int] = []

    def _score(self, outputs, prompts):
        if self.release is not None:
            self.release.wait(10)
        return self.answer(outputs) if self.answer else [2.0 * o for o in outputs]

    def submit(self, outputs, prompts):
        self.submitted += 1
        self.submit_threads.append(threading.get_ident())
        return self.pool.submit(self._score, list(outputs), list(prompts))

    def __call__(self, outputs, prompts):
        return self.submit(outputs, prompts).result()


class WithInputs(Submitted):
    uses_inputs = True

    def submit(self, outputs, prompts, inputs=None):
        self.submitted += 1
        return self.pool.submit(lambda: [o - i["target"] for o, i in zip(outputs, inputs)])

    def __call__(self, outputs, prompts, inputs=None):
        return self.submit(outputs, prompts, inputs=inputs).result()


def test_ascore_gives_what_score_gives_and_awaits_submit_without_a_thread():
    loop_threads: list[int] = []
    plain_threads: list[int] = []

    def plain(outputs, prompts):
        plain_threads.append(threading.get_ident())
        return [1.0] * len(outputs)

    judged, targets = Submitted(), WithInputs()
    rewards = [RewardFn("judge", judged, weight=0.5), RewardFn("plain", plain), RewardFn("target", targets)]
    a, b = _samples(3), _samples(3)
    RewardSet(rewards).score(a)

    async def main():
        loop_threads.append(threading.get_ident())
        await RewardSet(rewards).ascore(b)

    asyncio.run(main())
    assert [s.rewards for s in b] == [s.rewards for s in a]
    assert [s.rewards for s in b] == [{"judge": 2.0 * i, "plain": 1.0, "target": -9.0 * i} for i in range(3)]
    assert [s.reward for s in b] == [s.reward for s in a] == [1.0 + i - 9.0 * i for i in range(3)]
    assert judged.submitted == 2 and targets.submitted == 2  # score's __call__ submits too
    assert plain_threads[-1] != loop_threads[0]  # a plain reward never blocks the loop
    assert judged.submit_threads[-1] == loop_threads[0]  # submitted from the loop itself: no thread per call
    assert RewardSet([RewardFn("judge", judged)]).submittable
    assert not RewardSet(rewards).submittable and RewardSet(rewards).batch_capacity == 0
    judged.capacity = 3
    assert RewardSet([RewardFn("judge", judged)]).batch_capacity == 3
    assert RewardSet([RewardFn("judge", judged), RewardFn("target", targets)]).batch_capacity == 1  # declares none


def test_overlapping_ascore_calls_run_at_once():
    release = threading.Event()
    judged = Submitted(release)
    rewards = RewardSet([RewardFn("judge", judged)])

    async def main():
        first = asyncio.ensure_future(rewards.ascore(_samples(2)))
        second = asyncio.ensure_future(rewards.ascore(_samples(2)))
        for _ in range(200):  # both submitted while neither has an answer
            if judged.submitted == 2:
                break
            await asyncio.sleep(0.01)
        submitted = judged.submitted
        release.set()
        await asyncio.gather(first, second)
        return submitted

    assert asyncio.run(main()) == 2


def test_ascore_deadline_and_failures():
    never = Submitted(threading.Event())  # never released within the deadline

    async def score(rewards, samples):
        await rewards.ascore(samples)

    with pytest.raises(RewardError, match=r"Required reward 'judge' failed on 2 sample\(s\): RewardTimeout: no "
                                          r"answer within 0.2 s"):
        asyncio.run(score(RewardSet([RewardFn("judge", never)], timeout_s=0.2), _samples(2)))
    never.release.set()

    samples = _samples(2)
    broken = Submitted(answer=lambda outputs: [float("nan")] * len(outputs))
    asyncio.run(score(RewardSet([RewardFn("ok", Submitted()), RewardFn("broken", broken, required=False)]), samples))
    assert all("broken" not in s.rewards and s.reward == s.rewards["ok"] for s in samples)

    def raises(outputs, prompts):
        raise RuntimeError("judge down")

    with pytest.raises(RewardError, match="Required reward 'down' failed on 2 sample.*RuntimeError: judge down"):
        asyncio.run(score(RewardSet([RewardFn("down", raises)]), _samples(2)))


def test_a_submit_that_raises_is_the_rewards_failure(caplog):
    class Refuses(Submitted):
        def submit(self, outputs, prompts):
            raise ValueError("cannot encode")

    samples = _samples(2)
    with caplog.at_level(logging.WARNING, logger="omnirl.rewards"):
        asyncio.run(RewardSet([RewardFn("ok", Submitted()), RewardFn("enc", Refuses(), required=False)])
                    .ascore(samples))
    assert all("enc" not in s.rewards for s in samples)
    assert "optional reward enc failed on 2 sample(s), dropped for their groups: ValueError: cannot encode" \
        in caplog.text
