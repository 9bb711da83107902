"""GRPO-Guard over the flow-model contract: FlowGRPO with a normalised ratio and per-step reweighting.

With Gaussian transitions of std h, the raw log-ratio of a sample drawn by the old policy has mean
-KL = -mean((mu_theta - mu_old)^2) / (2 h^2): negative, and large where h is small (late steps), so the
clip acts one-sidedly there. GRPO-Guard adds that bias back and rescales by h:
  b = mean over dims (mu_theta - mu_old)^2 / (2 h^2)
  rho~ = exp((logp_theta - logp_old + b) * h)
which is exp(mean(z * (mu_theta - mu_old))) for x' = mu_old + h z: zero-mean log, with a variance that no
longer depends on h. The clipped surrogate uses rho~, and each step's loss is divided by D = s - s' so that
every step contributes a gradient of the same scale.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from omnirl_core.config import RunConfig
from omnirl_core.contracts import RolloutPlan
from omnirl_core.flow.policy_gradient import (
    FlowPolicyGradient,
    FlowPolicyGradientOptions,
    Transition,
    TransitionBatch,
    clipped_surrogate,
)
from omnirl_core.flow.sampler import mean_over_dims


class GRPOGuardConfig(FlowPolicyGradientOptions):
    sampler: Literal["sde", "dance"] = Field(
        "sde", description="Stochastic sampler of the trained steps: Flow-SDE or Dance-SDE (Gaussian log-probs)."
    )
    clip_range: float = Field(2e-6, gt=0, description="Clip e on the normalised ratio (2e-6 in the reference).")
    normalize_ratio: bool = Field(True, description="Use the normalised ratio rho~ (False: FlowGRPO's ratio).")
    reweight_steps: bool = Field(True, description="Divide each step's loss by its step size D = s - s'.")
    beta: float = Field(0.04, ge=0, description="KL weight to the reference (base model); 0 turns it off.")
    global_std: bool = Field(True, description="Normalise advantages by the batch std (True) or per group.")


def normalized_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                         std: torch.Tensor) -> torch.Tensor:
    """(logp_theta - logp_old + b) * h, b = mean over dims (mu_theta - mu_old)^2 / (2 h^2); per transition."""
    bias = mean_over_dims((mean - old_mean) ** 2) / (2 * std**2)
    return (logp - old_logp + bias) * std


class GRPOGuard(FlowPolicyGradient):
    needs_old_mean = True

    def __init__(self, options: GRPOGuardConfig | None, config: RunConfig):
        super().__init__(options or GRPOGuardConfig(), config)
        o = self.options
        trained = tuple(range(max(self.num_steps - 1, 1)))
        kinds = tuple(o.sampler if i in trained else "ode" for i in range(self.num_steps))
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=trained, eta=o.noise_level)

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, units: list[Transition],
                  mean: torch.Tensor, std: torch.Tensor, batch: TransitionBatch) -> tuple[torch.Tensor, dict]:
        o = self.options
        raw = torch.exp(logp - old)
        if o.normalize_ratio:
            old_mean = torch.stack([u.old_mean for u in units]).to(mean.device)
            ratio = torch.exp(normalized_log_ratio(logp, old, mean, old_mean, std))
        else:
            ratio = raw
        per_unit = clipped_surrogate(ratio, adv, o.clip_range)
        if o.reweight_steps:
            per_unit = per_unit / (batch.s - batch.s_next).to(per_unit.device)
        return per_unit, {
            "clip_frac": float(((ratio.detach() - 1.0).abs() > o.clip_range).float().mean()),
            "ratio/mean": float(ratio.detach().mean()),
            "ratio/raw_mean": float(raw.detach().mean()),
        }
