"""DanceGRPO: the Dance-SDE against independent computations, shared group noise, the random trained steps,
summed per-reward advantages, best/worst-k, and a run through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omnirl_plugin_dancegrpo.algorithm import DanceGRPO, DanceGRPOConfig, extremes, summed_advantages

from omnirl_core.config import RunConfig
from omnirl_core.errors import ConfigError
from omnirl_core.flow.sampler import sample_step, step_mean, transition_logprob
from omnirl_core.testing.forkserver import run_omnirl


def _config(**rollout) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"num_steps": 10, "group_size": 8, **rollout},
                                     "rewards": [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}]})


def _sample(uid: int, group: int, rewards: dict[str, float], seed: int | None = None, plan=None):
    request = SimpleNamespace(uid=uid, group=group, seed=seed if seed is not None else 1000 + uid, plan=plan)
    weights = {"a": 1.0, "b": 0.5}
    return SimpleNamespace(request=request, rewards=rewards, reward=sum(weights[k] * v for k, v in rewards.items()),
                           advantage=0.0)


# -- the Dance-SDE --------------------------------------------------------------------------------------

def test_dance_sde_mean_from_the_noise_estimate_and_gaussian_logprob():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    s, s_next, eta = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.8, 0.5, 0.0]), 0.7
    mean, std = step_mean("dance", x, v, s, s_next, eta)
    # independent form: score = -eps_hat / s with eps_hat = x + (1 - s) v
    d = (s - s_next).view(-1, 1, 1, 1)
    sb = s.view(-1, 1, 1, 1)
    eps_hat = x + (1 - sb) * v
    torch.testing.assert_close(mean, x - d * v - d * eta**2 / (2 * sb) * eps_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std, eta * torch.sqrt(s - s_next))
    # finite at s = 1 (the Flow-SDE's noise scale is not)
    assert torch.isfinite(mean).all() and torch.isfinite(std).all()
    out = sample_step("dance", x, v, s, s_next, eta, noise=torch.randn(3, 4, 6, 6, generator=g))
    reference = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(out.prev_sample)
    torch.testing.assert_close(out.logprob, reference.flatten(1).mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(transition_logprob("dance", out.prev_sample, mean, std), out.logprob)


# -- rollout plan, shared noise, trained steps ----------------------------------------------------------

def test_plan_is_dance_sde_everywhere_with_shared_group_noise():
    algo = DanceGRPO(DanceGRPOConfig(noise_level=0.3), _config())
    plan = algo.plan(1)
    assert plan.step_kinds == ("dance",) * 10 and plan.train_steps == tuple(range(10))
    assert plan.shared_initial_noise and plan.eta == 0.3


def test_controller_gives_a_group_one_initial_noise(tmp_path: Path):
    from omnirl_core.loop.controller import Controller
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_entry_points()
    layers = [{"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "dancegrpo"},
               "rollout": {"prompts_per_step": 3, "group_size": 4}}]
    requests = Controller(resolve_run(manager, layers, probe_device=False), tmp_path).requests(1)
    by_group: dict[int, set[int]] = {}
    for r in requests:
        by_group.setdefault(r.group, set()).add(r.noise_seed)
    assert len(by_group) == 3 and all(len(seeds) == 1 for seeds in by_group.values())
    assert len(set().union(*by_group.values())) == 3  # groups differ
    assert len({r.seed for r in requests}) == 12  # the SDE noise still differs per sample


def test_each_sample_trains_its_own_random_subset_of_steps():
    algo = DanceGRPO(DanceGRPOConfig(timestep_fraction=0.6), _config())
    plan = algo.plan(1)
    samples = [_sample(i, i // 4, {"a": float(i), "b": 0.0}, plan=plan) for i in range(8)]
    units = algo.training_units(samples)
    per_sample: dict[int, list[int]] = {}
    for u in units:
        per_sample.setdefault(u.sample.request.uid, []).append(u.step)
    assert all(len(steps) == 6 and len(set(steps)) == 6 for steps in per_sample.values())  # round(0.6 * 10)
    assert len({tuple(s) for s in per_sample.values()}) > 1  # not the same subset for everyone
    again = [(u.sample.request.uid, u.step) for u in algo.training_units(samples)]
    assert again == [(u.sample.request.uid, u.step) for u in units]  # deterministic (the sample's seed)


# -- advantages -----------------------------------------------------------------------------------------

def test_multi_reward_advantage_is_the_sum_of_per_reward_group_advantages():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0, 1, 8), rng.normal(0, 100, 8)  # reward b spreads 100x wider
    samples = [_sample(i, i // 4, {"a": float(a[i]), "b": float(b[i])}) for i in range(8)]
    expected = np.zeros(8)
    for values, weight in ((a, 1.0), (b, 0.5)):
        for g in (0, 1):
            idx = slice(4 * g, 4 * g + 4)
            expected[idx] += weight * (values[idx] - values[idx].mean()) / (values[idx].std() + 1e-4)
    got = summed_advantages(samples, {"a": 1.0, "b": 0.5}, global_std=False, clip=None)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-4)
    algo = DanceGRPO(DanceGRPOConfig(adv_clip=5.0), _config())
    algo.assign_advantages(samples)
    np.testing.assert_allclose([s.advantage for s in samples], np.clip(expected, -5, 5), rtol=1e-4, atol=1e-4)
    # the weighted-sum mode normalises the combined reward instead: b dominates it
    ws = DanceGRPO(DanceGRPOConfig(multi_reward="weighted-sum"), _config())
    ws.assign_advantages(samples)
    assert not np.allclose([s.advantage for s in samples], np.clip(expected, -5, 5), atol=1e-2)


def test_best_worst_k_keeps_the_extremes_of_each_group():
    rewards = [0.5, 0.9, 0.1, 0.4, 0.7, 0.2, 0.3, 0.8]
    samples = [_sample(i, i // 4, {"a": r}) for i, r in enumerate(rewards)]
    kept = extremes(samples, 2)
    assert [s.request.uid for s in kept] == [1, 2, 5, 7]  # group 0: 0.9 / 0.1; group 1: 0.8 / 0.2
    with pytest.raises(ConfigError, match="best_worst_k"):
        DanceGRPO(DanceGRPOConfig(best_worst_k=16), _config())


# -- end to end -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_run_with_two_rewards(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_omnirl(["train", "--model", "qwen-image", "--algo", "dancegrpo", "--preset", "tiny", "--output-dir",
                       str(run), "--steps", "2", "--reward", "color", "--reward", "jpeg:0.1", "--set", "rollout.prompts_per_step=2",
                       "--set", "rollout.group_size=4", "--set", "algorithm.options.best_worst_k=2"],
                       timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    first = records[0]
    assert first["logprob/abs_delta_max"] <= 1e-5  # the trainer re-evaluates the rollout's numbers exactly
    assert "reward/color" in first and "reward/jpeg" in first
    assert 0 < first["advantage/abs_mean"] <= 5
