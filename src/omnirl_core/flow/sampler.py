"""Flow-matching sampler math, shared by rollout and training (one implementation, fp32).

Notation (ALGORITHMS.md): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, the network
predicts v ~ eps - x0. A step goes from s to s' < s; dt = s' - s < 0; D = -dt.

Every stochastic step is written as a Gaussian transition x' = mu + std * z. ``step_mean`` computes
(mu, std) from (x, v, s, s'); rollout draws z and records log p(x' | x); training re-evaluates the stored
x' under new weights with the same ``step_mean`` + ``transition_logprob``, so both sides compute the very
same numbers when the weights have not changed.

Deterministic solvers: ``ode`` (Euler) and ``dpm2`` (DPM-Solver++(2M), second order, multistep: it also
uses the previous step's data prediction, passed as ``history``). The forward process used by the
algorithms that train without log-probs (Diffusion-DPO, DiffusionNFT) is at the end of the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLERS = ("ode", "sde", "cps", "dance", "dpm2")
DETERMINISTIC = frozenset({"ode", "dpm2"})
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
    x0: torch.Tensor | None = None  # data prediction x - s v: the history a multistep solver needs next


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
    if kind in DETERMINISTIC:
        # Euler: x' = x + v dt (also DPM-Solver++'s first-order step in flow notation; ``dpm2`` with its
        # history is ``dpm_solver_2m_step``)
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
        # Dance-SDE (DanceGRPO): mean = x - D v + D (0.5 eta^2 score), constant noise scale eta sqrt(D), with
        # the score from the x0 estimate, -(x - (1 - s) x0_hat) / s^2 = -(x + (1 - s) v) / s exactly: the second
        # form avoids subtracting two nearly equal latents and dividing by s^2 (fp32 lost ~1e-4 at s = 1e-3)
        d = -dt
        eps_hat = x + (1 - sb) * v
        mean = x - d * v - (0.5 * eta**2) * (d / sb) * eps_hat
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
        if not bool((std > 0).all()):
            raise ValueError(f"the '{kind}' sampler needs a noise level eta > 0: with no noise its transition "
                             "has no density, and every log-prob would be NaN")
        stdb = _bcast(std, x_next)
        elem = -((x_next - mean) ** 2) / (2 * stdb**2) - torch.log(stdb) - _LOG_SQRT_2PI
        return mean_over_dims(elem)
    raise ValueError(f"sampler {kind!r} has no log-prob")


def gaussian_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians with the same std, averaged over dims: (mu_a - mu_b)^2 / (2 std^2)."""
    return mean_over_dims((mean_a - mean_b) ** 2 / (2 * _bcast(std, mean_a) ** 2))


def _lambda(s: torch.Tensor) -> torch.Tensor:
    """Half log-SNR of the flow path: log(alpha / sigma) with alpha = 1 - s, sigma = s."""
    return torch.log(1.0 - s) - torch.log(s)


def dpm_solver_2m_step(
    x: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    s_next: torch.Tensor,
    prev_x0: torch.Tensor | None,
    prev_s: torch.Tensor | None,
) -> torch.Tensor:
    """DPM-Solver++(2M), midpoint form, in flow-matching notation (alpha = 1 - s, sigma = s).

    With m0 = x - s v (the data prediction now) and m1 the previous step's, lambda = log(alpha / sigma):
      h = lambda' - lambda, r = (lambda - lambda_prev) / h, D = m0 + (m0 - m1) / (2 r)
      x' = (s' / s) x - alpha' (exp(-h) - 1) D
    First order (= Euler) per sample where there is no usable history (first step, previous sigma 1) and on
    the step to sigma 0 (lambda' infinite: x' = m0 exactly, as both orders agree there).
    """
    x, v, s, s_next = x.float(), v.float(), s.float(), s_next.float()
    m0 = x - _bcast(s, x) * v
    euler = x + v * _bcast(s_next - s, x)
    if prev_x0 is None or prev_s is None:
        return euler
    prev_s = prev_s.float()
    second = (prev_s < 1.0) & (prev_s > s) & (s_next > 0.0)
    if not bool(second.any()):
        return euler
    # evaluate the second-order branch only on safe values; the mask picks it where it is defined
    safe_prev = torch.where(second, prev_s, (s + 1.0) / 2)
    safe_next = torch.where(second, s_next, s / 2)
    lam, lam_next, lam_prev = _lambda(s), _lambda(safe_next), _lambda(safe_prev)
    h = lam_next - lam
    r = (lam - lam_prev) / h
    d = m0 + _bcast(1.0 / (2.0 * r), x) * (m0 - prev_x0.float())
    second_order = _bcast(safe_next / s, x) * x - _bcast((1.0 - safe_next) * torch.expm1(-h), x) * d
    return torch.where(_bcast(second, x), second_order, euler)


def sample_step(
    kind: str,
    x: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    s_next: torch.Tensor,
    eta: float,
    noise: torch.Tensor | None = None,
    sigma_max: torch.Tensor | None = None,
    history: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> StepOut:
    """One rollout step: x' = mean + std * noise (noise drawn by the caller, per request, for batch invariance).

    ``history`` = (x0 prediction, sigma) of each sample's previous step (``StepOut.x0`` and its ``s``), used by
    the multistep ``dpm2`` solver and ignored by every other kind."""
    x0 = x.float() - _bcast(s.float(), x) * v.float()
    if kind == "dpm2":
        prev_x0, prev_s = history if history is not None else (None, None)
        nxt = dpm_solver_2m_step(x, v, s, s_next, prev_x0, prev_s)
        return StepOut(nxt, nxt, torch.zeros_like(s.float()), None, x0)
    mean, std = step_mean(kind, x, v, s, s_next, eta, sigma_max)
    if kind == "ode":
        return StepOut(mean, mean, std, None, x0)
    if noise is None:
        raise ValueError(f"sampler {kind!r} needs noise")
    prev = mean + _bcast(std, mean) * noise.float()
    return StepOut(prev, mean, std, transition_logprob(kind, prev, mean, std), x0)


# -- the forward process (training without log-probs) ------------------------------------------------

def noised(x0: torch.Tensor, eps: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x_s = (1 - s) x0 + s eps, with s of shape (B,)."""
    sb = _bcast(s.float(), x0)
    return (1.0 - sb) * x0.float() + sb * eps.float()


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching regression target u = eps - x0."""
    return eps.float() - x0.float()


def training_sigmas(
    n: int,
    generator: torch.Generator,
    kind: str = "uniform",
    low: float = 0.0,
    high: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """n training noise levels in [low, high]: uniform, or logit-normal (sigmoid of N(mean, std))."""
    if kind == "uniform":
        u = torch.rand(n, generator=generator)
    elif kind == "logit-normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    else:
        raise ValueError(f"unknown sigma distribution {kind!r}; expected 'uniform' or 'logit-normal'")
    return low + (high - low) * u
