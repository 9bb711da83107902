"""FlowGRPO's KL conventions on the same tensors: ``flow_grpo`` against a re-implementation of flow_grpo's own
formulas (``sde_step_with_logprob`` and the KL of scripts/train_sd3.py, github.com/yifan123/flow_grpo, commit
ac4c86e; CPS as in its later ``sde_type="cps"`` branch), ``exact`` against the closed-form Gaussian KL, and the
relation between the two (a factor D = s - s' per Flow-SDE step). The loss goes through ``FlowGRPO.loss`` with a
toy linear velocity model whose reference is another weight matrix."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig, kl_term

from omnirl_core.config import RunConfig
from omnirl_core.contracts import Conditioning, GenRequest, Sample
from omnirl_core.flow.policy_gradient import transition_stats
from omnirl_core.flow.sampler import step_mean
from omnirl_core.loop.training import MetricMean, prepare_all

SIGMAS = torch.tensor([1.0, 0.82, 0.61, 0.37, 0.0])  # starts at 1: flow_grpo's sigma_max substitution is exercised
ETA = 0.7


# -- flow_grpo, re-implemented from its source (names as there) --------------------------------------------------
def flow_grpo_step(model_output, sample, sigma, sigma_prev, sigma_max, noise_level, sde_type="sde"):
    """``sde_step_with_logprob``: (prev_sample_mean, std_dev_t), sigma / sigma_prev of shape (B, 1, 1, 1)."""
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                            + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
        return prev_sample_mean, std_dev_t
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    prev_sample_mean = (pred_original_sample * (1 - sigma_prev)
                        + noise_estimate * torch.sqrt(sigma_prev**2 - std_dev_t**2))
    return prev_sample_mean, std_dev_t


def flow_grpo_kl(prev_sample_mean, prev_sample_mean_ref, std_dev_t):
    """train_sd3.py: ((mu - mu_ref)^2).mean(dim=(1, 2, 3), keepdim=True) / (2 std_dev_t^2), then torch.mean."""
    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    return torch.mean(kl_loss)


# -- a toy flow model: v = W x * (1 + s) + per-prompt bias; the reference uses W_ref -----------------------------
class LinearFlow:
    device = torch.device("cpu")

    def __init__(self, channels: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight_ref = torch.randn(channels, channels, generator=g) / channels
        self.weight = torch.nn.Parameter(self.weight_ref + 0.1 * torch.randn(channels, channels, generator=g))
        self._in_reference = False

    def velocity(self, x, s, cond, guidance_scale=1.0, uncond=None):
        w = self.weight_ref if self._in_reference else self.weight
        return torch.einsum("oc,bchw->bohw", w, x) * (1 + s.view(-1, 1, 1, 1)) + cond.tensors["bias"][..., None, None]

    @contextmanager
    def reference(self):
        self._in_reference = True
        try:
            yield
        finally:
            self._in_reference = False


def _samples(algo: FlowGRPO, n: int = 3, seed: int = 1) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    plan = algo.plan(0)
    out = []
    for i in range(n):
        request = GenRequest(uid=i, prompt=f"p{i}", prompt_index=i, group=0, seed=i, height=8, width=8, plan=plan)
        latents = torch.randn(len(SIGMAS), 4, 6, 6, generator=g)
        cond = Conditioning({"bias": torch.randn(1, 4, generator=g)})
        sample = Sample(request, latents, SIGMAS.clone(), torch.full((len(SIGMAS) - 1,), float("nan")), None,
                        advantage=float(i - 1), cond=cond)
        out.append(sample)
    return out


def _with_rollout_logprobs(algo: FlowGRPO, model: LinearFlow, samples: list[Sample]) -> list[Sample]:
    """Rollout log-probs = the trainer's under the current weights (no correction noise in the test)."""
    units = algo.training_units(samples)
    with torch.no_grad():
        _, _, logp, _ = transition_stats(model, units, algo.plan(0).eta)
    for unit, lp in zip(units, logp):
        unit.sample.logprobs[unit.step] = lp
    return samples


def _loss(convention: str, beta: float, sampler: str = "sde"):
    """FlowGRPO's loss and its gradient on W, one micro-batch holding every trained transition."""
    config = RunConfig.model_validate({"rollout": {"num_steps": len(SIGMAS) - 1}})
    algo = FlowGRPO(FlowGRPOConfig(sampler=sampler, noise_level=ETA if sampler == "sde" else 0.8, beta=beta,
                                   kl_convention=convention, clip_range=0.2), config)
    model = LinearFlow()
    units = algo.training_units(_with_rollout_logprobs(algo, model, _samples(algo)))
    with torch.no_grad():
        prepare_all(algo, model, units, len(units), MetricMean())  # the runtime's no-grad pass
    loss, metrics = algo.loss(model, units)
    (grad,) = torch.autograd.grad(loss, [model.weight])
    return loss.detach(), grad, metrics, units, model


def _flow_grpo_reference_kl(units, model: LinearFlow, sde_type: str, noise_level: float) -> torch.Tensor:
    """flow_grpo's KL of every trained transition, averaged over steps and samples as its training loop does
    (one mean per step over the batch, every step the same weight), as a function of W (differentiable)."""
    per_step = []
    for step in sorted({u.step for u in units}):
        batch = [u for u in units if u.step == step]
        sample = torch.stack([u.sample.latents[step] for u in batch])
        sigma = torch.stack([u.sample.sigmas[step] for u in batch]).view(-1, 1, 1, 1)
        sigma_prev = torch.stack([u.sample.sigmas[step + 1] for u in batch]).view(-1, 1, 1, 1)
        cond = Conditioning.cat([u.sample.cond for u in batch])
        s = sigma.flatten()
        mean, std_dev_t = flow_grpo_step(model.velocity(sample, s, cond), sample, sigma, sigma_prev, SIGMAS[1].item(),
                                         noise_level, sde_type)
        with model.reference(), torch.no_grad():
            mean_ref, _ = flow_grpo_step(model.velocity(sample, s, cond), sample, sigma, sigma_prev, SIGMAS[1].item(),
                                         noise_level, sde_type)
        per_step.append(flow_grpo_kl(mean, mean_ref, std_dev_t))
    return torch.stack(per_step).mean()


@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_flow_grpo_convention_equals_flow_grpos_own_kl(sampler: str):
    beta = 0.04
    loss_0, grad_0, _, _, _ = _loss("flow_grpo", 0.0, sampler)
    loss_kl, grad_kl, metrics, units, model = _loss("flow_grpo", beta, sampler)
    reference = _flow_grpo_reference_kl(units, model, sampler, ETA if sampler == "sde" else 0.8)
    (reference_grad,) = torch.autograd.grad(reference, [model.weight])
    assert float(reference.detach()) > 0
    torch.testing.assert_close(torch.tensor(metrics["kl"]), reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_kl - loss_0, beta * reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_kl - grad_0, beta * reference_grad, rtol=1e-5, atol=1e-6)


def test_exact_convention_is_the_gaussian_kl_and_larger_by_one_over_d_on_every_sde_step():
    beta = 0.04
    loss_0, _, _, _, _ = _loss("exact", 0.0)
    loss_exact, _, metrics_exact, units, model = _loss("exact", beta)
    _, _, metrics_fg, _, _ = _loss("flow_grpo", beta)
    # the exact term from torch's Normal KL, element by element, averaged over elements and transitions
    kls = []
    for u in units:
        x = u.sample.latents[u.step][None]
        s, s_next = u.sample.sigmas[u.step].view(1), u.sample.sigmas[u.step + 1].view(1)
        cond = u.sample.cond
        with torch.no_grad():
            mean, std = step_mean("sde", x, model.velocity(x, s, cond), s, s_next, ETA, SIGMAS[1].view(1))
            with model.reference():
                mean_ref, _ = step_mean("sde", x, model.velocity(x, s, cond), s, s_next, ETA, SIGMAS[1].view(1))
        normal = torch.distributions.Normal
        kls.append(torch.distributions.kl_divergence(normal(mean, std), normal(mean_ref, std)).mean())
        d = float(s - s_next)
        fg = kl_term("flow_grpo", "sde", mean, mean_ref, std, s, s_next)
        torch.testing.assert_close(fg, kl_term("exact", "sde", mean, mean_ref, std, s, s_next) * d)
    exact = torch.stack(kls).mean()
    torch.testing.assert_close(torch.tensor(metrics_exact["kl"]), exact, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(loss_exact - loss_0, beta * exact, rtol=1e-6, atol=1e-7)
    # with these steps (D = 0.18 .. 0.24) the exact term is 4 to 6 times flow_grpo's
    assert 4 < metrics_exact["kl"] / metrics_fg["kl"] < 6


def test_without_kl_the_conventions_give_the_same_loss():
    loss_a, grad_a, _, _, _ = _loss("exact", 0.0)
    loss_b, grad_b, _, _, _ = _loss("flow_grpo", 0.0)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)


def test_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="unknown KL convention"):
        kl_term("flowgrpo", "cps", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1), torch.zeros(1))
