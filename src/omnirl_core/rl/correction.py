"""Rollout correction: IS diagnostics and the rejection-sampling (RS) mask (ALGORITHMS.md).

Three log-probs meet in an update: the rollout's (recorded by the rollout engine), the trainer's
pre-update one (recompute mode) and the current one (with grad). The per-step mismatch
``delta = logp_train - logp_rollout`` is recorded on each sample (``sample.extras["is_delta"]``, one
entry per trained step), so that a sample's sequence weight ``w = exp(mean or sum of its deltas)`` can
be formed even when its steps are spread over several micro-batches.

Recompute mode: every delta is recorded in ``prepare`` (one extra forward), before any loss, so the
sequence weights are exact. Bypass mode skips that forward: each step's delta comes from its own first
(detached) evaluation in the loss. Minibatches hold whole samples (``training.minibatches``), so all
steps of a sample are evaluated at the same weights; a unit's mask is decided from its sample's steps seen
so far, and ``FlowPolicyGradient.finish_minibatch`` returns the units whose mask changed once the sample
was complete, for the engine to fix before the optimizer step (``training.rs_corrections``). In the first
minibatch the weights are the rollout's (up to the engine mismatch), so w measures the mismatch exactly;
later minibatches also see the policy's drift since the rollout, which bypass mode treats as
off-policyness just as its PPO ratio exp(current - rollout) does. The step-level diagnostics are
reported from the first minibatch only.

``FallbackMonitor``: in bypass mode, when the rejected fraction stays above a threshold for a number of
steps, the run switches to recompute mode (ALGORITHMS.md: fall back to recompute if it stays > 5 %).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omnirl_core.contracts import TrainingUnit
    from omnirl_core.flow.policy_gradient import Transition

DELTA_KEY = "is_delta"


def record_deltas(units: Sequence[Transition], logp_train: torch.Tensor, overwrite: bool = True) -> torch.Tensor:
    """Store delta = logp_train - logp_rollout per (sample, step); returns the deltas (N,).

    ``overwrite=False`` keeps a step's first recorded delta (bypass: later evaluations include updates)."""
    rollout = torch.stack([u.rollout_logprob for u in units]).to(logp_train.device)
    delta = logp_train.detach().float() - rollout.float()
    for unit, d in zip(units, delta.tolist()):
        recorded = unit.sample.extras.setdefault(DELTA_KEY, {})
        if overwrite or unit.step not in recorded:
            recorded[unit.step] = d
    return delta


def sequence_log_weights(units: Sequence[Transition], aggregate: str = "mean") -> torch.Tensor:
    """log w of each unit's sample, from the deltas recorded on it so far: (N,)."""
    out = []
    for unit in units:
        deltas = list(unit.sample.extras.get(DELTA_KEY, {}).values())
        if not deltas:
            out.append(0.0)
        elif aggregate == "sum":
            out.append(math.fsum(deltas))
        else:
            out.append(math.fsum(deltas) / len(deltas))
    return torch.tensor(out, dtype=torch.float32)


def rs_mask(log_w: torch.Tensor, band: tuple[float, float] | None) -> torch.Tensor:
    """1.0 where the sequence weight lies in [low, high] (or no band), else 0.0: rejected whole."""
    if band is None:
        return torch.ones_like(log_w)
    low, high = band
    w = torch.exp(log_w)
    return ((w >= low) & (w <= high)).float()


def step_diagnostics(delta: torch.Tensor) -> dict[str, float]:
    """Per trained step: |delta| mean / max, and the k1 / k3 estimates of KL(rollout || train).

    With r = p_train / p_rollout = exp(delta) and samples drawn by the rollout policy:
    k1 = E[-log r], k3 = E[r - 1 - log r] (unbiased, always >= 0)."""
    delta = delta.double()
    ratio = torch.exp(delta)
    return {
        "logprob/abs_delta_mean": float(delta.abs().mean()),
        "logprob/abs_delta_max": float(delta.abs().max()),
        "is/kl_k1": float((-delta).mean()),
        "is/kl_k3": float((ratio - 1 - delta).mean()),
    }


def sequence_diagnostics(units: Sequence[TrainingUnit], log_w: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sequence weights (one per sample, not per step): mean / max, normalised effective sample size
    ESS / n = (sum w)^2 / (n sum w^2) in (0, 1], and the fraction of samples the RS mask rejects."""
    first: dict[int, int] = {}
    for i, unit in enumerate(units):
        first.setdefault(id(unit.sample), i)
    idx = torch.tensor(list(first.values()), dtype=torch.long)
    w = torch.exp(log_w.double()[idx])
    ess = float(w.sum() ** 2 / (len(w) * (w**2).sum())) if len(w) else 1.0
    return {
        "is/seq_weight_mean": float(w.mean()),
        "is/seq_weight_max": float(w.max()),
        "is/ess": ess,
        "rs/rejected_frac": float(1.0 - mask[idx].mean()),
    }


class FallbackMonitor:
    """Bypass -> recompute when the RS mask keeps rejecting: the rollout's log-probs are then too far from
    the trainer's to stand in for the old policy. Counts consecutive steps whose ``rs/rejected_frac``
    exceeds ``threshold``; ``observe`` answers True once, at the step the streak reaches ``steps``."""

    def __init__(self, threshold: float | None, steps: int):
        self.threshold = threshold
        self.steps = steps
        self.streak = 0

    def observe(self, mode: str, metrics: dict[str, float]) -> bool:
        frac = metrics.get("rs/rejected_frac")
        if mode != "bypass" or self.threshold is None or frac is None:
            self.streak = 0
            return False
        self.streak = self.streak + 1 if frac > self.threshold else 0
        return self.streak >= self.steps

    def state(self) -> dict[str, int]:
        return {"streak": self.streak}

    def load_state(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
