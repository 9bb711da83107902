"""DiffusionNFT: the optimality probability, the loss against an independent computation, the direction it
moves the policy, the EMA sampler policy (used for the rollout, then for v_old), and a CLI run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omnirl_plugin_nft.algorithm import DiffusionNFT, NFTConfig, nft_loss, optimality

from omnirl_core.config import RunConfig
from omnirl_core.errors import UsageError
from omnirl_core.rl.ema import ShadowParameters
from omnirl_core.testing.forkserver import run_omnirl


def _config() -> RunConfig:
    return RunConfig.model_validate({"rollout": {"num_steps": 6}})


def test_optimality_probability_matches_a_numpy_computation():
    rng = np.random.default_rng(0)
    rewards = rng.normal(0, 1, 12)
    groups = np.repeat([0, 1, 2], 4)
    centred = rewards - np.array([rewards[groups == g].mean() for g in groups])
    expected_global = 0.5 + 0.5 * np.clip(centred / rewards.std(), -1, 1)
    group_std = np.array([rewards[groups == g].std() for g in groups])
    expected_group = 0.5 + 0.5 * np.clip(centred / group_std, -1, 1)
    r, g = torch.tensor(rewards), torch.tensor(groups)
    np.testing.assert_allclose(optimality(r, g, True, clip=1.0).numpy(), expected_global, rtol=1e-5)
    np.testing.assert_allclose(optimality(r, g, False, clip=1.0).numpy(), expected_group, rtol=1e-5)
    assert optimality(r, g, False, clip=1.0).min() >= 0 and optimality(r, g, False, clip=1.0).max() <= 1


def _tensors(seed: int = 0, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 4, 6, 6)
    return (torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g),
            torch.randn(shape, generator=g), torch.tensor([0.2, 0.5, 0.9]), torch.tensor([1.0, 0.0, 0.3]))


def test_velocity_loss_matches_the_formula_written_out():
    v, v_old, x0, eps, s, r = _tensors()
    beta = 0.7
    got = nft_loss(v, v_old, x0, eps, s, r, beta, "velocity")
    u = eps - x0
    for i in range(3):
        pos = (((1 - beta) * v_old[i] + beta * v[i] - u[i]) ** 2).mean()
        neg = (((1 + beta) * v_old[i] - beta * v[i] - u[i]) ** 2).mean()
        assert float(got[i]) == pytest.approx(float(r[i] * pos + (1 - r[i]) * neg), rel=1e-5)
    # beta = 1: the positive policy is the current one, the negative its reflection through v_old
    one = nft_loss(v, v_old, x0, eps, s, r, 1.0, "velocity")
    expected = r * ((v - u) ** 2).flatten(1).mean(1) + (1 - r) * ((2 * v_old - v - u) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(one, expected)


def test_x0_space_loss_is_the_velocity_error_scaled_by_s_over_its_mean_abs():
    v, v_old, x0, eps, s, r = _tensors(1)
    beta = 1.0
    got = nft_loss(v, v_old, x0, eps, s, r, beta, "x0")
    u = eps - x0
    # x0_hat - x0 = (x_s - s v+) - x0 = -s (v+ - u): squared / mean-abs = s * mse / mae of (v+ - u)
    def term(d, si):
        return si * (d**2).mean() / d.abs().mean()
    for i in range(3):
        pos = term(v[i] - u[i], s[i])
        neg = term(2 * v_old[i] - v[i] - u[i], s[i])
        assert float(got[i]) == pytest.approx(float(r[i] * pos + (1 - r[i]) * neg), rel=1e-4)


@pytest.mark.parametrize("r, closer", [(1.0, True), (0.0, False)])
def test_a_gradient_step_pulls_good_samples_in_and_pushes_bad_ones_out(r: float, closer: bool):
    v_old, x0, eps = (t[:1] for t in _tensors(2)[1:4])
    s, u = torch.tensor([0.5]), eps - x0
    v = v_old.clone().requires_grad_(True)
    loss = nft_loss(v, v_old, x0, eps, s, torch.tensor([r]), 1.0, "velocity").sum()
    loss.backward()
    stepped = v.detach() - 0.1 * v.grad
    before, after = float(((v_old - u) ** 2).mean()), float(((stepped - u) ** 2).mean())
    assert (after < before) == closer


# -- the sampler policy -------------------------------------------------------------------------------

def test_shadow_parameters_ema_and_swap():
    net = torch.nn.Linear(2, 2)
    shadow = ShadowParameters(list(net.parameters()))
    w0 = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    shadow.update(0.25)
    torch.testing.assert_close(shadow.shadow[0], 0.25 * w0 + 0.75 * (w0 + 1.0))
    with shadow.swapped():
        torch.testing.assert_close(net.weight, shadow.shadow[0])
    torch.testing.assert_close(net.weight, w0 + 1.0)  # the trained weights are back
    with pytest.raises(ValueError):
        shadow.update(1.5)


def test_ema_schedule_and_the_rollout_policy_hook():
    algo = DiffusionNFT(NFTConfig(ema_max=0.5, ema_rate=0.1, ema_delay=2), _config())
    assert [algo.decay(k) for k in (0, 1, 2, 3, 4, 9)] == [0.0, 0.0, 0.0, pytest.approx(0.1), pytest.approx(0.2),
                                                            0.5]
    net = torch.nn.Linear(2, 2)
    model = SimpleNamespace(trainable_parameters=lambda: list(net.parameters()))
    seen, synced = [], []
    for step in range(5):
        with algo.rollout_policy(model):
            seen.append(net.weight.detach().clone())  # what the rollout samples with
        with torch.no_grad():
            net.weight.add_(1.0)  # the update of this step
        algo.after_update(model)  # the actor folds it into the EMA
        with algo.sync_policy(model):  # what a separate rollout worker would receive now
            synced.append(net.weight.detach().clone())
    # updates 1 and 2 lie inside the delay (the sampler copies the policy), then lam = 0.1, 0.2
    w0 = seen[0]
    expected = [w0, w0 + 1, w0 + 2, 0.1 * (w0 + 2) + 0.9 * (w0 + 3)]
    expected.append(0.2 * expected[3] + 0.8 * (w0 + 4))
    for got, want in zip(seen, expected):
        torch.testing.assert_close(got, want)
    # a split rollout worker gets, after update k, what a colocated rollout k + 1 samples with
    for got, want in zip(synced[:4], seen[1:]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(net.weight, w0 + 5)  # the trained weights are back after each swap
    assert algo.state() == {"updates": 5}
    resumed = DiffusionNFT(NFTConfig(ema_max=0.5, ema_rate=0.1, ema_delay=2), _config())
    resumed.load_state(algo.state())
    resumed.load_state_tensors(algo.state_tensors(), model)
    with resumed.rollout_policy(model):  # the EMA with update 5 folded in (lam 0.3), as uninterrupted
        torch.testing.assert_close(net.weight, 0.3 * expected[4] + 0.7 * (w0 + 5))
    with pytest.raises(UsageError, match="needs a model"), algo.rollout_policy(None):
        pass


@pytest.mark.slow
def test_split_placement_samples_with_the_synced_ema_like_colocated(tmp_path: Path, monkeypatch):
    """Ray with a separate rollout worker: the actor syncs the EMA sampler weights (not the trained ones),
    so the run equals the inline one, where the rollout swaps the EMA in itself."""
    from omnirl_core.testing import run_train

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as in a Ray actor under 1 CPU: the same float reductions

    args = ["--model", "qwen-image", "--algo", "nft", "--preset", "tiny", "--steps", "3",
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
            "--set", "algorithm.options.ema_rate=0.3", "--set", "run.worker_cpus=0.5"]
    inline = run_train(tmp_path / "inline", *args)
    split = run_train(tmp_path / "split", *args, "--executor", "ray", "--set", "run.placement=split",
                      "--set", "run.reward_workers=1")
    assert inline[2]["nft/sampler_lag_rms"] > 0  # the EMA lags the policy: syncing the policy would differ
    for a, b in zip(inline, split):
        for key in ("reward/mean", "nft/sampler_lag_rms", "nft/policy_loss", "nft/ema_decay"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["step"], key)


def test_rollout_is_deterministic_ode_without_training_steps():
    plan = DiffusionNFT(NFTConfig(ode_solver="dpm2"), _config()).plan(1)
    assert plan.step_kinds == ("dpm2",) * 6 and plan.train_steps == ()


@pytest.mark.slow
def test_cli_run_samples_with_the_ema_policy(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_omnirl(["train", "--model", "qwen-image", "--algo", "nft", "--preset", "tiny", "--output-dir", str(run),
                       "--steps", "3", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                       "--set", "algorithm.options.ema_rate=0.3"], timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # step 1: the sampler is the policy; from step 2 on it lags behind the trained weights (lam 0.3, 0.5)
    assert records[0]["nft/sampler_lag_rms"] == 0.0 and records[0]["nft/ema_decay"] == 0.0
    assert records[1]["nft/ema_decay"] == pytest.approx(0.3) and records[2]["nft/ema_decay"] == pytest.approx(0.5)
    assert records[2]["nft/sampler_lag_rms"] > 0.0
    assert 0.0 < records[0]["nft/optimality_mean"] < 1.0
    ckpt = run / "checkpoints" / "step-000003"
    assert json.loads((ckpt / "algorithm.json").read_text()) == {"updates": 3}  # folded after each update
    assert (ckpt / "algorithm.safetensors").is_file()  # the EMA sampler policy's weights
