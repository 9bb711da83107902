"""The sampler math against independent computations."""

import math

import pytest
import torch

from omnirl_core.flow.sampler import gaussian_kl, sample_step, step_mean, transition_logprob


def _inputs(b=3, shape=(4, 6, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *shape, generator=g)
    v = torch.randn(b, *shape, generator=g)
    s = torch.tensor([0.9, 0.6, 0.3])[:b]
    s_next = torch.tensor([0.8, 0.45, 0.1])[:b]
    return x, v, s, s_next, g


def test_flow_sde_logprob_matches_torch_distributions():
    x, v, s, s_next, g = _inputs()
    noise = torch.randn(x.shape, generator=g)
    out = sample_step("sde", x, v, s, s_next, 0.7, noise)
    normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1).expand_as(out.mean))
    expected = normal.log_prob(out.prev_sample).reshape(3, -1).mean(dim=1)
    torch.testing.assert_close(out.logprob, expected, rtol=1e-6, atol=1e-6)


def test_flow_sde_mean_and_std_follow_the_formula():
    x, v, s, s_next, _ = _inputs()
    eta = 0.7
    mean, std = step_mean("sde", x, v, s, s_next, eta)
    for i in range(3):
        si, sn = float(s[i]), float(s_next[i])
        dt = sn - si
        a = eta * math.sqrt(si / (1 - si))
        mu = x[i] * (1 + a**2 * dt / (2 * si)) + v[i] * (1 + a**2 * (1 - si) / (2 * si)) * dt
        torch.testing.assert_close(mean[i], mu, rtol=1e-5, atol=1e-6)
        assert std[i].item() == pytest.approx(a * math.sqrt(si - sn), rel=1e-6)


def test_sde_with_zero_noise_level_is_the_euler_ode():
    x, v, s, s_next, _ = _inputs()
    sde_mean, std = step_mean("sde", x, v, s, s_next, 0.0)
    ode_mean, _ = step_mean("ode", x, v, s, s_next, 0.0)
    torch.testing.assert_close(sde_mean, ode_mean)
    torch.testing.assert_close(ode_mean, x + v * (s_next - s).view(-1, 1, 1, 1))
    assert torch.all(std == 0)


def test_sigma_one_uses_second_sigma_in_the_denominator():
    x, v, _, _, _ = _inputs(b=1)
    s = torch.tensor([1.0])
    s_next = torch.tensor([0.9])
    mean, std = step_mean("sde", x, v, s, s_next, 0.7, sigma_max=torch.tensor([0.9]))
    assert torch.isfinite(mean).all() and torch.isfinite(std).all()
    assert std.item() == pytest.approx(0.7 * math.sqrt(1.0 / 0.1) * math.sqrt(0.1), rel=1e-5)


def test_dance_sde_logprob_is_gaussian():
    x, v, s, s_next, g = _inputs()
    noise = torch.randn(x.shape, generator=g)
    out = sample_step("dance", x, v, s, s_next, 0.3, noise)
    assert torch.allclose(out.std, 0.3 * torch.sqrt(s - s_next))
    normal = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1).expand_as(out.mean))
    torch.testing.assert_close(out.logprob, normal.log_prob(out.prev_sample).reshape(3, -1).mean(1))


def test_cps_keeps_the_noise_coefficient_and_scores_unnormalised():
    x, v, s, s_next, _ = _inputs()
    eta = 0.8
    mean, std = step_mean("cps", x, v, s, s_next, eta)
    torch.testing.assert_close(std, s_next * math.sin(eta * math.pi / 2))
    x_next = mean + 0.1
    assert torch.allclose(transition_logprob("cps", x_next, mean, std), torch.full((3,), -0.01), atol=1e-6)


def test_gaussian_kl_closed_form_matches_torch():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 3, 5, 5, generator=g)
    std = torch.tensor([0.3, 0.5])
    ours = gaussian_kl(a, b, std)
    sd = std.view(-1, 1, 1, 1).expand_as(a)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(a, sd), torch.distributions.Normal(b, sd))
    torch.testing.assert_close(ours, ref.reshape(2, -1).mean(1))


def test_ode_has_no_logprob_and_stochastic_steps_need_noise():
    x, v, s, s_next, _ = _inputs()
    assert sample_step("ode", x, v, s, s_next, 0.0).logprob is None
    with pytest.raises(ValueError, match="needs noise"):
        sample_step("sde", x, v, s, s_next, 0.7)
