"""Flow-matching sampler math, shared by rollout and training (one implementation, fp32).

Notation (ALGORITHMS.md): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, the network
predicts v ~ eps - x0. A step goes from s to s' < s; dt = s' - s < 0; D = -dt.

Every stochastic step is written as a Gaussian transition x' = mu + std * z. ``step_mean`` computes
(mu, std) from (x, v, s, s'); rollout draws z and records log p(x' | x); training re-evaluates the stored
x' under new weights with the same ``step_mean`` + ``transition_logprob``, so both sides compute the very
same numbers when the weights have not changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLERS = ("ode", "sde", "cps", "dance")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) to broadcast over one sample's latent dims."""
    return t.reshape(t.shape[0], *([1] * (like.dim() - 1)))


def mean_over_dims(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).mean(dim=1)


@dataclass
class StepOut:
    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor  # (B,) per-sample std (0 for ODE)
    logprob: torch.Tensor | None  # (B,) or None for the ODE


def step_mean(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    s_next: torch.Tensor,
    eta: float,
    sigma_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the transition x -> x' for sampler ``kind``; all inputs fp32, s/s_next of shape (B,).

    ``sigma_max`` (B,) replaces s in the Flow-SDE denominator where s == 1 (the schedule's second sigma).
    """
    x = x.float()
    v = v.float()
    s = s.float()
    s_next = s_next.float()
    sb, snb = _bcast(s, x), _bcast(s_next, x)
    dt = snb - sb
    if kind == "ode":
        # Euler: x' = x + v dt
        return x + v * dt, torch.zeros_like(s)
    if kind == "sde":
        # Flow-SDE (FlowGRPO): a_s = eta sqrt(s / (1 - s)); second sigma in the denominator at s = 1
        denom_s = s if sigma_max is None else torch.where(s >= 1.0, sigma_max.float(), s)
        a = eta * torch.sqrt(s / (1.0 - denom_s))
        ab = _bcast(a, x)
        mean = x * (1 + ab**2 * dt / (2 * sb)) + v * (1 + ab**2 * (1 - sb) / (2 * sb)) * dt
        std = a * torch.sqrt(s - s_next)
        return mean, std
    if kind == "cps":
        # coefficients-preserving sampling: keep the noise/signal coefficients of the flow path
        s_noise = s_next * math.sin(eta * math.pi / 2)
        x0_hat = x - sb * v
        eps_hat = x + (1 - sb) * v
        mean = (1 - snb) * x0_hat + _bcast(torch.sqrt(s_next**2 - s_noise**2), x) * eps_hat
        return mean, s_noise
    if kind == "dance":
        # Dance-SDE (DanceGRPO): score from the x0 estimate, constant noise scale eta sqrt(D)
        d = -dt
        x0_hat = x - sb * v
        score = -(x - (1 - sb) * x0_hat) / sb**2
        mean = x - d * v + d * (0.5 * eta**2 * score)
        std = eta * torch.sqrt(s - s_next)
        return mean, std
    raise ValueError(f"unknown sampler kind {kind!r}; expected one of {SAMPLERS}")


def transition_logprob(kind: str, x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log p(x' | x), averaged over the latent dims of each sample (the references average, not sum)."""
    x_next = x_next.float()
    if kind == "cps":
        # unnormalised: only differences matter, the normaliser cancels in ratios
        return -mean_over_dims((x_next - mean) ** 2)
    if kind in ("sde", "dance"):
        stdb = _bcast(std, x_next)
        elem = -((x_next - mean) ** 2) / (2 * stdb**2) - torch.log(stdb) - _LOG_SQRT_2PI
        return mean_over_dims(elem)
    raise ValueError(f"sampler {kind!r} has no log-prob")


def gaussian_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians with the same std, averaged over dims: (mu_a - mu_b)^2 / (2 std^2)."""
    return mean_over_dims((mean_a - mean_b) ** 2 / (2 * _bcast(std, mean_a) ** 2))


def sample_step(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    s_next: torch.Tensor,
    eta: float,
    noise: torch.Tensor | None = None,
    sigma_max: torch.Tensor | None = None,
) -> StepOut:
    """One rollout step: x' = mean + std * noise (noise drawn by the caller, per request, for batch invariance)."""
    mean, std = step_mean(kind, x, v, s, s_next, eta, sigma_max)
    if kind == "ode":
        return StepOut(mean, mean, std, None)
    if noise is None:
        raise ValueError(f"sampler {kind!r} needs noise")
    prev = mean + _bcast(std, mean) * noise.float()
    return StepOut(prev, mean, std, transition_logprob(kind, prev, mean, std))
