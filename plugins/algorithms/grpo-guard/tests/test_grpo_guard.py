"""GRPO-Guard: the normalised ratio is zero-mean under the old policy and independent of the noise level,
the per-step reweighting, the Flow-SDE log-density and KL against torch.distributions, and a CLI run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omnirl_plugin_grpo_guard.algorithm import GRPOGuard, GRPOGuardConfig, normalized_log_ratio

from omnirl_core.config import RunConfig
from omnirl_core.flow.policy_gradient import clipped_surrogate
from omnirl_core.flow.sampler import gaussian_kl, sample_step, step_mean, transition_logprob
from omnirl_core.testing.forkserver import run_omnirl


def _gaussian_pair(h: float, n: int = 4000, dims: int = 64, seed: int = 0, shift: float | None = None):
    """Old and new means that differ slightly (by ``shift`` per dim in scale, default 0.05 h), and n samples
    x' ~ N(mu_old, h^2) from the old policy."""
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(1, dims, generator=g).expand(n, dims)
    mu_new = mu_old + (0.05 * h if shift is None else shift) * torch.randn(1, dims, generator=g)
    z = torch.randn(n, dims, generator=g)
    std = torch.full((n,), h)
    x_next = mu_old + h * z
    logp_new = transition_logprob("sde", x_next, mu_new, std)
    logp_old = transition_logprob("sde", x_next, mu_old, std)
    return logp_new, logp_old, mu_new, mu_old, std, z


@pytest.mark.parametrize("h", [0.5, 0.02])
def test_normalized_log_ratio_is_zero_mean_on_samples_from_the_old_policy(h: float):
    logp_new, logp_old, mu_new, mu_old, std, z = _gaussian_pair(h)
    raw = logp_new - logp_old
    kl = torch.distributions.kl_divergence(torch.distributions.Normal(mu_old, h), torch.distributions.Normal(mu_new, h))
    # the raw log-ratio is biased: its expectation is -KL(old || new), averaged over dims
    se_raw = raw.std() / len(raw) ** 0.5
    assert abs(float(raw.mean() + kl.mean(1)[0])) < 4 * se_raw
    assert float(raw.mean()) < -4 * float(se_raw)
    norm = normalized_log_ratio(logp_new, logp_old, mu_new, mu_old, std)
    se = norm.std() / len(norm) ** 0.5
    assert abs(float(norm.mean())) < 4 * float(se)
    # closed form: (log-ratio + b) * h = mean over dims of z * (mu_new - mu_old)
    torch.testing.assert_close(norm, (z * (mu_new - mu_old)).mean(1), rtol=1e-3, atol=1e-6)


def test_normalized_ratio_spread_does_not_depend_on_the_noise_level():
    # one mean shift seen at two noise levels 25x apart: the raw log-ratio spreads 25x more at the small one
    norms, raws = [], []
    for h in (0.5, 0.02):
        logp_new, logp_old, mu_new, mu_old, std, _ = _gaussian_pair(h, shift=1e-3)
        norms.append(float(normalized_log_ratio(logp_new, logp_old, mu_new, mu_old, std).std()))
        raws.append(float((logp_new - logp_old).std()))
    assert raws[1] / raws[0] == pytest.approx(25, rel=0.05)
    assert norms[1] / norms[0] == pytest.approx(1, rel=0.05)


def test_flow_sde_logprob_and_kl_match_torch_distributions():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    s, s_next = torch.tensor([0.9, 0.4]), torch.tensor([0.7, 0.2])
    out = sample_step("sde", x, v, s, s_next, 0.7, noise=torch.randn(2, 4, 8, 8, generator=g))
    normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1))
    torch.testing.assert_close(out.logprob, normal.log_prob(out.prev_sample).flatten(1).mean(1), rtol=1e-5, atol=1e-5)
    other_mean, _ = step_mean("sde", x, v * 1.1, s, s_next, 0.7)
    kl = torch.distributions.kl_divergence(normal, torch.distributions.Normal(other_mean, out.std.view(-1, 1, 1, 1)))
    torch.testing.assert_close(gaussian_kl(out.mean, other_mean, out.std), kl.flatten(1).mean(1), rtol=1e-5, atol=1e-6)


def test_surrogate_uses_the_normalised_ratio_and_divides_each_step_by_its_size():
    config = RunConfig.model_validate({"rollout": {"num_steps": 6}})
    guard = GRPOGuard(GRPOGuardConfig(clip_range=0.1), config)
    logp_new, logp_old, mu_new, mu_old, std, _ = _gaussian_pair(0.3, n=4)
    units = [SimpleNamespace(old_mean=m) for m in mu_old]
    batch = SimpleNamespace(s=torch.tensor([0.9, 0.8, 0.5, 0.3]), s_next=torch.tensor([0.8, 0.5, 0.3, 0.25]))
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    per_unit, metrics = guard.surrogate(logp_new, logp_old, adv, units, mu_new, std, batch)
    ratio = torch.exp(z_dot := normalized_log_ratio(logp_new, logp_old, mu_new, mu_old, std))
    expected = clipped_surrogate(ratio, adv, 0.1) / (batch.s - batch.s_next)
    torch.testing.assert_close(per_unit, expected)
    assert metrics["ratio/mean"] == pytest.approx(float(torch.exp(z_dot).mean()))
    plain = GRPOGuard(GRPOGuardConfig(clip_range=0.1, normalize_ratio=False, reweight_steps=False), config)
    per_plain, _ = plain.surrogate(logp_new, logp_old, adv, units, mu_new, std, batch)
    torch.testing.assert_close(per_plain, clipped_surrogate(torch.exp(logp_new - logp_old), adv, 0.1))


def test_guard_asks_the_trainer_for_the_old_means():
    guard = GRPOGuard(None, RunConfig.model_validate({"rollout": {"num_steps": 6}}))
    assert guard.needs_old_mean and guard.plan(1).train_steps == (0, 1, 2, 3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "bypass"])
def test_cli_run(tmp_path: Path, mode: str):
    run = tmp_path / "run"
    proc = run_omnirl(["train", "--model", "qwen-image", "--algo", "grpo-guard", "--preset", "tiny", "--output-dir",
                       str(run), "--steps", "2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                       "--set", f"train.old_logprob={mode}"], timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    # before the first update the normalised ratio is exactly 1 (bias 0, log-ratio 0)
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
    assert all(abs(r["ratio/mean"] - 1) < 1e-2 and r["kl"] >= 0 for r in records)
