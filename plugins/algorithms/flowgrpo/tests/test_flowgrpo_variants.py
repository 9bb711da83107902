"""FlowGRPO's CPS sampler and its fast (window) variant: the CPS step against independent facts (it
preserves the flow path's coefficients; eta 0 is Euler), the Flow-SDE at s = 1, the plans, and CLI runs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig

from omnirl_core.config import RunConfig
from omnirl_core.errors import ConfigError
from omnirl_core.flow.sampler import sample_step, step_mean, transition_logprob
from omnirl_core.testing.forkserver import run_omnirl


def _config(num_steps: int = 6) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"num_steps": num_steps}})


def _exact_path(n: int, s: float, seed: int = 0):
    """x_s on the flow path with its true velocity v = eps - x0."""
    g = torch.Generator().manual_seed(seed)
    x0, eps = torch.randn(n, 4, 8, 8, generator=g), torch.randn(n, 4, 8, 8, generator=g)
    return (1 - s) * x0 + s * eps, eps - x0, x0, eps


def test_cps_step_preserves_the_flow_path_coefficients():
    s, s_next, eta = 0.7, 0.4, 0.8
    x, v, x0, eps = _exact_path(2000, s)
    ones = torch.ones(2000)
    out = sample_step("cps", x, v, s * ones, s_next * ones, eta, noise=torch.randn(x.shape))
    s_noise = s_next * math.sin(eta * math.pi / 2)
    # with the true velocity the mean is (1 - s') x0 + sqrt(s'^2 - s_n^2) eps: signal kept, noise partly fresh
    torch.testing.assert_close(out.mean, (1 - s_next) * x0 + math.sqrt(s_next**2 - s_noise**2) * eps,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std, torch.full((2000,), s_noise))
    # so x' - (1 - s') x0 has exactly the noise scale s' of the path at s' (the Flow-SDE's does not)
    assert float((out.prev_sample - (1 - s_next) * x0).std()) == pytest.approx(s_next, rel=0.01)
    sde = sample_step("sde", x, v, s * ones, s_next * ones, eta, noise=torch.randn(x.shape))
    assert abs(float((sde.prev_sample - (1 - s_next) * x0).std()) - s_next) > 0.02


def test_cps_logprob_is_the_unnormalised_squared_distance_and_eta0_is_euler():
    x, v, _, _ = _exact_path(3, 0.6, seed=1)
    s, s_next = torch.full((3,), 0.6), torch.full((3,), 0.3)
    out = sample_step("cps", x, v, s, s_next, 0.8, noise=torch.randn(x.shape))
    torch.testing.assert_close(out.logprob, -((out.prev_sample - out.mean) ** 2).flatten(1).mean(1))
    other, _ = step_mean("cps", x, v * 0.9, s, s_next, 0.8)
    ratio = torch.exp(transition_logprob("cps", out.prev_sample, other, out.std) - out.logprob)
    expected = torch.exp(((out.prev_sample - out.mean) ** 2 - (out.prev_sample - other) ** 2).flatten(1).mean(1))
    torch.testing.assert_close(ratio, expected)
    mean0, std0 = step_mean("cps", x, v, s, s_next, 0.0)
    euler, _ = step_mean("ode", x, v, s, s_next, 0.0)
    torch.testing.assert_close(mean0, euler, rtol=1e-5, atol=1e-5)
    assert torch.equal(std0, torch.zeros(3))


def test_flow_sde_uses_the_second_sigma_at_s_equal_1_and_eta0_is_euler():
    x, v, _, _ = _exact_path(2, 1.0, seed=2)
    s, s_next, second = torch.ones(2), torch.full((2,), 0.8), torch.full((2,), 0.8)
    mean, std = step_mean("sde", x, v, s, s_next, 0.7, sigma_max=second)
    a = 0.7 * math.sqrt(1.0 / (1 - 0.8))
    dt = -0.2
    torch.testing.assert_close(std, torch.full((2,), a * math.sqrt(0.2)))
    torch.testing.assert_close(mean, x * (1 + a**2 * dt / 2) + v * (1 + 0) * dt, rtol=1e-5, atol=1e-5)
    mean0, _ = step_mean("sde", x, v, torch.full((2,), 0.5), torch.full((2,), 0.3), 0.0)
    torch.testing.assert_close(mean0, x - 0.2 * v)


def test_default_plan_trains_all_but_the_last_step():
    plan = FlowGRPO(FlowGRPOConfig(sampler="cps", noise_level=0.8), _config()).plan(1)
    assert plan.step_kinds == ("cps",) * 5 + ("ode",) and plan.train_steps == (0, 1, 2, 3, 4)


def test_window_variant_is_sde_and_trained_only_in_the_window():
    plan = FlowGRPO(FlowGRPOConfig(window=2, window_start=1), _config(10)).plan(7)
    assert plan.step_kinds == ("ode", "sde", "sde") + ("ode",) * 7 and plan.train_steps == (1, 2)
    with pytest.raises(ConfigError, match="exceeds 10 steps"):
        FlowGRPO(FlowGRPOConfig(window=3, window_start=8), _config(10))
    with pytest.raises(ConfigError, match="CPS adds no noise"):
        FlowGRPO(FlowGRPOConfig(sampler="cps", window=2, window_start=8), _config(10))
    # the SDE variant may train the last step (its noise is a_s sqrt(s))
    assert FlowGRPO(FlowGRPOConfig(window=2, window_start=8), _config(10)).plan(1).train_steps == (8, 9)


def _cli(tmp_path: Path, *extra: str) -> list[dict]:
    run = tmp_path / "run"
    proc = run_omnirl(["train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--output-dir",
                       str(run), "--steps", "2", "--set", "rollout.prompts_per_step=2",
                       "--set", "rollout.group_size=4", *extra], timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cli_cps_run(tmp_path: Path):
    records = _cli(tmp_path, "--set", "algorithm.options.sampler=cps", "--set", "algorithm.options.noise_level=0.8")
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
    assert all(math.isfinite(r["kl"]) and r["kl"] >= 0 for r in records)
    assert records[1]["kl"] > 0  # after one update the policy has moved off the reference


@pytest.mark.slow
def test_cli_window_run(tmp_path: Path):
    records = _cli(tmp_path, "--set", "algorithm.options.window=2", "--set", "algorithm.options.window_start=1",
                   "--set", "algorithm.options.beta=0")
    assert records[0]["logprob/abs_delta_max"] <= 1e-5 and all(r["kl"] == 0.0 for r in records)
