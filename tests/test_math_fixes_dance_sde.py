"""Dance-SDE's transition mean at small sigma (issue 30, learning math): the fp32 mean against the same formula
evaluated in fp64, and rollout and training computing it through one function."""

from __future__ import annotations

import pytest
import torch

from omnirl_core.flow.sampler import sample_step, step_mean, transition_logprob


def _dance_mean_fp64(x: torch.Tensor, v: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor,
                     eta: float) -> torch.Tensor:
    """DanceGRPO's formula as ALGORITHMS.md writes it, in fp64: x0_hat = x - s v,
    score = -(x - (1 - s) x0_hat) / s^2, mean = x - D v + D (0.5 eta^2 score)."""
    x, v = x.double(), v.double()
    sb, snb = s.double().view(-1, 1, 1, 1), s_next.double().view(-1, 1, 1, 1)
    d = sb - snb
    x0_hat = x - sb * v
    score = -(x - (1 - sb) * x0_hat) / sb**2
    return x - d * v + d * (0.5 * eta**2 * score)


def _inputs(s0: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 8, 8, generator=g)
    v = torch.randn(4, 16, 8, 8, generator=g)
    s = torch.full((4,), s0)
    s_next = torch.tensor([0.0, 0.5, 0.9, 0.99]) * s0  # the last step, a halving, two short steps
    return x, v, s, s_next


# Before the fix the fp32 mean (x - (1 - s) x0_hat cancels, then is divided by s^2) was off by 1.0e-5 .. 1.1e-4 at
# s = 1e-3 and 1.2e-4 .. 1.3e-3 at s = 1e-4 (eta 0.3 .. 1.0); rewritten without the cancellation it is off by at
# most 4.4e-7 at every s here (2.3e-7 at s = 1e-3): the bound is 4.5x the new error, 5x to 56x below the old one.
BOUND = 2e-6


@pytest.mark.parametrize("s0", [0.9, 0.5, 0.1, 1e-2, 1e-3, 1e-4])
@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_dance_mean_matches_fp64_at_small_sigma(s0: float, eta: float):
    x, v, s, s_next = _inputs(s0)
    mean, std = step_mean("dance", x, v, s, s_next, eta)
    assert mean.dtype == torch.float32
    err = float((mean.double() - _dance_mean_fp64(x, v, s, s_next, eta)).abs().max())
    assert err < BOUND, f"s={s0} eta={eta}: fp32 Dance-SDE mean off by {err:.2e} from fp64"
    torch.testing.assert_close(std, eta * torch.sqrt(s - s_next))


def test_rollout_and_training_compute_the_same_dance_numbers():
    """The rollout's step (``sample_step``) and the trainer's re-evaluation (``step_mean`` +
    ``transition_logprob``) are one computation: bitwise equal means and log-probs."""
    x, v, s, s_next = _inputs(1e-3)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    out = sample_step("dance", x, v, s, s_next, 0.7, noise)
    mean, std = step_mean("dance", x, v, s, s_next, 0.7)
    assert torch.equal(out.mean, mean) and torch.equal(out.std, std)
    assert torch.equal(out.logprob, transition_logprob("dance", out.prev_sample, mean, std))
