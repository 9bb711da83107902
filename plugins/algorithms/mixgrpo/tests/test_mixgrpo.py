"""MixGRPO: the sliding window, the mixed plan, the Flash solver (checked against diffusers' DPM-Solver++ and
against an exact flow), and end-to-end runs through the CLI on the tiny Qwen-Image preset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omnirl_plugin_mixgrpo.algorithm import MixGRPO, MixGRPOConfig, mixed_plan, window_start

from omnirl_core.config import RunConfig
from omnirl_core.errors import ConfigError
from omnirl_core.flow.sampler import sample_step
from omnirl_core.testing.forkserver import run_omnirl


def _config(num_steps: int = 10, seed: int = 0) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"num_steps": num_steps}, "run": {"seed": seed}})


# -- the window ---------------------------------------------------------------------------------------

def test_progressive_window_advances_every_interval_and_rolls_back():
    o = MixGRPOConfig(window_size=4, window_shift_interval=3, window_stride=2, window_max_start=6)
    starts = [window_start(o, num_steps=10, step=k, seed=0) for k in range(1, 17)]
    # shifts every 3 steps by 2 within 0..6 (4 positions: 0, 2, 4, 6), then back to 0
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 0, 0, 0, 2]


def test_random_window_is_the_same_on_every_rank_and_varies_over_steps():
    o = MixGRPOConfig(window_size=2, window_schedule="random")
    rank0 = MixGRPO(o, _config(num_steps=10, seed=3))
    rank1 = MixGRPO(o, _config(num_steps=10, seed=3))
    windows = [rank0.window(k) for k in range(1, 41)]
    assert windows == [rank1.window(k) for k in range(1, 41)]
    starts = {w[0] for w in windows}
    assert len(starts) >= 5 and min(starts) >= 0 and max(starts) <= 8
    assert windows != [MixGRPO(o, _config(num_steps=10, seed=4)).window(k) for k in range(1, 41)]


def test_frozen_window_stays_at_the_minimum_start():
    o = MixGRPOConfig(window_size=2, window_schedule="frozen", window_min_start=1)
    assert {MixGRPO(o, _config()).window(k) for k in range(1, 30)} == {(1, 2)}


def test_plan_is_sde_and_trained_only_inside_the_window():
    plan = mixed_plan(MixGRPOConfig(window_size=3, sampler="dance", noise_level=0.7), num_steps=8, start=2)
    assert plan.step_kinds == ("ode", "ode", "dance", "dance", "dance", "ode", "ode", "ode")
    assert plan.train_steps == (2, 3, 4)
    assert plan.eta == 0.7 and plan.sigma_indices is None and plan.shared_initial_noise


def test_flash_plan_compresses_the_steps_after_the_window_with_the_second_order_solver():
    plan = mixed_plan(MixGRPOConfig(window_size=2, flash=True, flash_compression=3), num_steps=12, start=1)
    # steps 0 (ode), 1-2 (window), then schedule points 3 -> 6 -> 9 -> 12 in three dpm2 steps
    assert plan.sigma_indices == (0, 1, 2, 3, 6, 9, 12)
    assert plan.step_kinds == ("ode", "sde", "sde", "dpm2", "dpm2", "dpm2")  # the default window SDE: Flow-SDE
    assert plan.train_steps == (1, 2) and plan.schedule_steps == 12
    full = torch.linspace(1.0, 0.0, 13)
    assert torch.equal(plan.sigmas_from(full), full[[0, 1, 2, 3, 6, 9, 12]])
    # a compression that does not divide the rest still ends at the last schedule point
    odd = mixed_plan(MixGRPOConfig(window_size=2, flash=True, flash_compression=4), num_steps=10, start=0)
    assert odd.sigma_indices == (0, 1, 2, 6, 10)


def test_window_that_does_not_fit_is_a_config_error():
    with pytest.raises(ConfigError, match="does not fit"):
        MixGRPO(MixGRPOConfig(window_size=6), _config(num_steps=4))
    with pytest.raises(ConfigError, match="does not fit"):
        MixGRPO(MixGRPOConfig(window_size=2, window_max_start=9), _config(num_steps=10))
    with pytest.raises(ConfigError, match="CPS adds no noise"):
        MixGRPO(MixGRPOConfig(window_size=2, sampler="cps"), _config(num_steps=10))
    assert MixGRPO(MixGRPOConfig(window_size=2, sampler="cps", window_max_start=7), _config(num_steps=10))


# -- the Flash solver ---------------------------------------------------------------------------------

def _toy_velocity(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    a = torch.tensor([[0.3, -0.2, 0.1, 0.0], [0.1, 0.2, -0.3, 0.2], [0.0, 0.1, 0.2, -0.1], [-0.2, 0.0, 0.1, 0.3]])
    return torch.tanh(x @ a) + s.view(-1, 1) * x


def _solve(kind: str, x: torch.Tensor, sigmas: torch.Tensor, velocity) -> list[torch.Tensor]:
    states, history = [], None
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i].expand(len(x)), sigmas[i + 1].expand(len(x))
        out = sample_step(kind, x, velocity(x, s), s, s_next, 0.0, history=history)
        history, x = (out.x0, s), out.prev_sample
        states.append(x)
    return states


def test_dpm2_matches_diffusers_dpm_solver_pp_2m():
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
                                            prediction_type="flow_prediction", use_flow_sigmas=True,
                                            final_sigmas_type="zero")
    scheduler.set_timesteps(num_inference_steps=7)
    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    reference, x = [], x0.clone()
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(_toy_velocity(x, scheduler.sigmas[i].expand(3)), t, x).prev_sample
        reference.append(x)
    ours = _solve("dpm2", x0.clone(), scheduler.sigmas.float(), _toy_velocity)
    for a, b in zip(reference, ours):
        torch.testing.assert_close(b, a.float(), atol=1e-6, rtol=1e-5)
    # and it is not Euler
    euler = _solve("ode", x0.clone(), scheduler.sigmas.float(), _toy_velocity)
    assert (euler[-1] - ours[-1]).abs().max() > 1e-3


def test_dpm2_converges_at_second_order_on_an_exact_gaussian_flow():
    """Data N(0, c^2): the flow x_s = x_a * sigma(s) / sigma(a), sigma(s)^2 = (1 - s)^2 c^2 + s^2, is exact."""
    c = 0.5

    def sigma(s):
        return ((1 - s) ** 2 * c**2 + s**2) ** 0.5

    def velocity(x, s):
        sb = s.view(-1, 1)
        return x * (sb - (1 - sb) * c**2) / ((1 - sb) ** 2 * c**2 + sb**2)

    x_a = torch.linspace(-2, 2, 5).view(5, 1).repeat(1, 3)
    errors = {}
    for kind in ("ode", "dpm2"):
        errors[kind] = [
            float((_solve(kind, x_a.clone(), torch.linspace(0.9, 0.1, n + 1), velocity)[-1]
                   - x_a * sigma(0.1) / sigma(0.9)).abs().max())
            for n in (16, 32, 64)
        ]
    euler_rates = [errors["ode"][i] / errors["ode"][i + 1] for i in range(2)]
    dpm_rates = [errors["dpm2"][i] / errors["dpm2"][i + 1] for i in range(2)]
    assert all(1.8 < r < 2.2 for r in euler_rates), euler_rates  # first order: halving h halves the error
    assert all(r > 3.5 for r in dpm_rates), dpm_rates  # second order: halving h quarters it
    assert errors["dpm2"][-1] < errors["ode"][-1] / 20


def test_dpm2_without_history_and_on_the_last_step_is_euler():
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    s, s_next = torch.full((2,), 0.6), torch.full((2,), 0.4)
    v = _toy_velocity(x, s)
    euler = sample_step("ode", x, v, s, s_next, 0.0).prev_sample
    assert torch.equal(sample_step("dpm2", x, v, s, s_next, 0.0).prev_sample, euler)
    # history from sigma 1 (infinite log-SNR) gives no usable slope: first order
    hist = (torch.randn(2, 4), torch.ones(2))
    assert torch.equal(sample_step("dpm2", x, v, s, s_next, 0.0, history=hist).prev_sample, euler)
    # the step to sigma 0 lands on the data prediction x - s v
    last = sample_step("dpm2", x, v, s, torch.zeros(2), 0.0, history=(torch.randn(2, 4), torch.full((2,), 0.8)))
    torch.testing.assert_close(last.prev_sample, x - 0.6 * v)


def test_flash_rollout_runs_the_schedule_subset_with_second_order_steps():
    """Through the installed rollout engine and the tiny Qwen-Image model (found by name, like a run does)."""
    from omnirl_core.config import ModelSection
    from omnirl_core.contracts import GenRequest
    from omnirl_core.plugins import PluginManager

    manager = PluginManager()
    manager.load_entry_points()
    model = manager.resolve("model", "qwen-image").load_factory()(
        ModelSection(name="qwen-image", preset="tiny"), None, "cpu")
    engine = manager.resolve("engine", "diffusers").load_factory()(model, None, "cpu")
    plan = mixed_plan(MixGRPOConfig(window_size=2, flash=True, flash_compression=2), num_steps=8, start=0)
    request = GenRequest(uid=0, prompt="a red square", prompt_index=0, group=0, seed=5, height=32, width=32,
                         plan=plan)
    sample = next(iter(engine.generate([request])))
    shape = tuple(model.latent_shape(32, 32))
    assert torch.equal(sample.sigmas, model.sigmas(8, shape)[[0, 1, 2, 4, 6, 8]])
    assert torch.isfinite(sample.logprobs[:2]).all() and torch.isnan(sample.logprobs[2:]).all()
    # replay the dpm2 steps from the stored trajectory: each used the previous step's data prediction
    cond = sample.cond
    with torch.no_grad():
        for i in (2, 3):  # step 4 goes to sigma 0: first order by construction
            x_prev, x, s_prev, s, s_next = (sample.latents[i - 1][None], sample.latents[i][None],
                                            sample.sigmas[i - 1:i], sample.sigmas[i:i + 1], sample.sigmas[i + 1:i + 2])
            x0_prev = x_prev - s_prev * model.velocity(x_prev, s_prev, cond)
            v = model.velocity(x, s, cond)
            second = sample_step("dpm2", x, v, s, s_next, 0.0, history=(x0_prev, s_prev)).prev_sample
            first = sample_step("ode", x, v, s, s_next, 0.0).prev_sample
            torch.testing.assert_close(sample.latents[i + 1][None], second, atol=1e-5, rtol=1e-5)
            assert (second - first).abs().max() > 1e-4


# -- end to end through the CLI -----------------------------------------------------------------------

def _train(tmp_path: Path, *extra: str) -> list[dict]:
    run = tmp_path / "run"
    args = ["train", "--model", "qwen-image", "--algo", "mixgrpo", "--preset", "tiny",
            "--output-dir", str(run), "--steps", "2", "--set", "rollout.prompts_per_step=2",
            "--set", "rollout.group_size=4", *extra]
    proc = run_omnirl(args, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cli_run_trains_only_the_window(tmp_path: Path):
    records = _train(tmp_path, "--set", "algorithm.options.window_shift_interval=1")
    assert [r["window/start"] for r in records] == [0.0, 1.0]
    assert records[0]["rollout/nfe"] == 6.0  # the tiny preset's 6 steps, all run
    # the trainer re-evaluates the window's stored transitions exactly as the rollout computed them
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
    assert all(abs(r["loss"]) < 1.0 for r in records)


@pytest.mark.slow
def test_cli_flash_run_takes_fewer_solver_steps(tmp_path: Path):
    records = _train(tmp_path, "--set", "algorithm.options.flash=true", "--set", "rollout.num_steps=10",
                     "--set", "algorithm.options.window_size=2", "--set", "algorithm.options.flash_compression=3")
    # window 0..1 (2 steps), then schedule points 2 -> 5 -> 8 -> 10: 5 model calls instead of 10
    assert records[0]["rollout/nfe"] == 5.0
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
