"""Async streaming reward: a finished sample is scored while the rollout is still producing the next
ones; sync mode scores after the rollout. Checked by event order, not by timing."""

from __future__ import annotations

import threading

import pytest

from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
from omnirl_core.rewards.dispatch import RewardError, RewardFn, RewardSet, RewardStream

PLAN = RolloutPlan(step_kinds=("ode",), train_steps=())


def _sample(i: int) -> Sample:
    req = GenRequest(uid=i, prompt=f"p{i}", prompt_index=i, group=0, seed=i, height=8, width=8, plan=PLAN)
    return Sample(request=req, latents=None, sigmas=None, logprobs=None, output=float(i))


def _rollout(n: int, scored_first: threading.Event, overlapped: list[bool]):
    """Yields n samples; before the last one, waits (briefly) to see whether sample 0 got scored."""
    for i in range(n):
        if i == n - 1:
            overlapped.append(scored_first.wait(timeout=5.0))
        yield _sample(i)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_async_scores_during_the_rollout_sync_after(mode: str):
    scored_first = threading.Event()

    def reward(outputs, prompts):
        if 0.0 in outputs:
            scored_first.set()
        return [2.0 * o for o in outputs]

    overlapped: list[bool] = []
    stream = RewardStream(RewardSet([RewardFn("double", reward, weight=0.5)]), workers=2, mode=mode)
    if mode == "sync":  # the wait would always time out: make it short
        scored_first.wait = lambda timeout=None: threading.Event.wait(scored_first, 0.05)  # type: ignore[method-assign]
    samples, timing = stream.run(_rollout(4, scored_first, overlapped))
    stream.close()
    assert overlapped == [mode == "async"]
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0]  # weight 0.5 x 2 x output
    assert [s.rewards["double"] for s in samples] == [0.0, 2.0, 4.0, 6.0]
    assert timing.busy_s >= 0 and timing.rollout_s > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_async_batches_what_piles_up_while_the_threads_are_busy(workers: int):
    """The first call holds every thread until the rollout has yielded all samples: what finished meanwhile is
    scored in batches of a fair share each (not one call per sample), each sample once, in its own place."""
    release = threading.Event()
    calls: list[list[float]] = []
    lock = threading.Lock()

    def reward(outputs, prompts):
        with lock:
            calls.append(list(outputs))
        release.wait(timeout=10.0)
        return [10.0 * o for o in outputs]

    def rollout():
        for i in range(9):
            yield _sample(i)
        release.set()

    stream = RewardStream(RewardSet([RewardFn("r", reward)]), workers=workers, mode="async", batch_async=True)
    samples, timing = stream.run(rollout())
    stream.close()
    assert [s.reward for s in samples] == [10.0 * i for i in range(9)]
    scored = sorted(o for call in calls for o in call)
    assert scored == [float(i) for i in range(9)]  # each sample exactly once
    assert len(calls) < 9 and max(len(c) for c in calls) > 1  # batched, not a call per sample
    assert timing.calls == len(calls) == len(stream.batches)
    assert max(len(c) for c in calls) <= -(-9 // workers)  # no thread takes more than its share


def test_failures_in_streamed_scoring():
    def broken(outputs, prompts):
        raise RuntimeError("judge down")

    ok = RewardFn("ok", lambda outs, prompts: [1.0] * len(outs))
    stream = RewardStream(RewardSet([ok, RewardFn("judge", broken, required=False)]), workers=2)
    samples, _ = stream.run(iter([_sample(0), _sample(1)]))
    assert all(s.reward == 1.0 and "judge" not in s.rewards for s in samples)  # settled per group later
    stream = RewardStream(RewardSet([RewardFn("judge", broken)]), workers=2)
    with pytest.raises(RewardError, match="Required reward 'judge' failed"):
        stream.run(iter([_sample(0)]))
    stream.close()


@pytest.mark.parametrize(("reward", "mode", "workers", "threads", "expected"), [
    ("ocr", "async", 1, None, 1),        # OCR declares 1 CPU: the rollout gives one core up
    ("ocr", "sync", 1, None, None),      # nothing overlaps: threads left alone
    ("color", "async", 2, None, None),   # declares no CPU
    ("vlm-judge", "async", 4, None, None),   # 0.1 CPU x 4 workers: less than a core
    ("ocr", "async", 1, 3, 3),           # set explicitly
])
def test_inline_rollout_gives_cpu_bound_rewards_their_cores(tmp_path, monkeypatch, reward, mode, workers, threads,
                                                           expected):
    import torch

    from omnirl_core.loop.executors import InlineExecutor
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                          "omnirl_plugin_diffusers", "omnirl_plugin_torch", "omnirl_plugin_color",
                          "omnirl_plugin_ocr", "omnirl_plugin_vlm_judge"])
    resolved = resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
        "rewards": [{"name": reward}],
        "run": {"device": "cpu", "output_dir": str(tmp_path), "reward_mode": mode, "reward_workers": workers,
                "rollout_threads": threads},
    }])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # as on a 2-core machine
    executor = InlineExecutor(resolved)
    executor.stream = RewardStream(RewardSet([RewardFn("r", lambda o, p: [0.0] * len(o))]), workers, mode)
    try:
        assert executor.rollout_threads() == expected
    finally:
        executor.stream.close()
