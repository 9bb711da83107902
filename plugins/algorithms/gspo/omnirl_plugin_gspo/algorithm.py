"""GSPO and token-level GRPO over the AR contract (no model-specific code).

Both: advantages A_i = (r_i - group mean) / (group std + 1e-4); old log-probs recomputed before the update
(or the rollout's, in bypass mode); optional KL to the base model (k3 estimator, weight beta).

GSPO (Zheng et al., 2025): s_i = exp(mean over tokens of (logp_theta - logp_old)), the length-normalised
sequence ratio; loss_i = -min(s_i A_i, clip(s_i, 1 - e_low, 1 + e_high) A_i).
GRPO (Shao et al., 2024): r_t = exp(logp_theta(y_t) - logp_old(y_t)) per token;
loss_i = mean over i's tokens of -min(r_t A_i, clip(r_t, 1 - e_low, 1 + e_high) A_i).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.ar.policy_gradient import TokenPolicyGradient, masked_mean
from omnirl_core.config import RunConfig


class _TokenPGConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = Field(0.0, ge=0, description="KL weight to the base model (k3 estimator per token, on the "
                        "distributions before the top-k / top-p cut); 0 turns it off and skips the reference forward.")
    adv_clip: float = Field(5.0, gt=0, description="Advantages are clipped to [-adv_clip, adv_clip].")
    global_std: bool = Field(False, description="Normalise advantages by the batch std (True) or per group "
                             "(False, as in the papers).")


class GSPOConfig(_TokenPGConfig):
    clip_low: float = Field(3e-4, gt=0, description="e_low: the sequence ratio is clipped below at 1 - e_low.")
    clip_high: float = Field(4e-4, gt=0, description="e_high: the sequence ratio is clipped above at 1 + e_high.")


class GRPOConfig(_TokenPGConfig):
    clip_low: float = Field(0.2, gt=0, description="e_low: each token ratio is clipped below at 1 - e_low.")
    clip_high: float = Field(0.2, gt=0, description="e_high: each token ratio is clipped above at 1 + e_high "
                             "(> e_low: the 'clip-higher' variant).")


def clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """PPO's pessimistic surrogate as a loss: max(-A rho, -A clip(rho, 1 - low, 1 + high))."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high))


def _clip_fraction(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ((ratio < 1.0 - low) | (ratio > 1.0 + high)).float()


class GSPO(TokenPolicyGradient):
    def __init__(self, options: GSPOConfig | None, config: RunConfig):
        super().__init__(options or GSPOConfig(), config)

    def surrogate(self, logp, old, mask, adv):
        o = self.options
        seq_ratio = torch.exp(masked_mean(logp - old, mask))  # length-normalised sequence ratio
        loss = clipped_objective(seq_ratio, adv, o.clip_low, o.clip_high)
        return loss, {
            "clip_frac": float(_clip_fraction(seq_ratio.detach(), o.clip_low, o.clip_high).mean()),
            "ratio/mean": float(seq_ratio.detach().mean()),
        }


class GRPO(TokenPolicyGradient):
    def __init__(self, options: GRPOConfig | None, config: RunConfig):
        super().__init__(options or GRPOConfig(), config)

    def surrogate(self, logp, old, mask, adv):
        o = self.options
        # masked positions: logp = old = 0, ratio 1, and the mask drops them from the mean
        ratio = torch.exp((logp - old) * mask)
        per_token = clipped_objective(ratio, adv[:, None], o.clip_low, o.clip_high)
        clipped = _clip_fraction(ratio.detach(), o.clip_low, o.clip_high)
        return masked_mean(per_token, mask), {
            "clip_frac": float((clipped * mask).sum() / mask.sum()),
            "ratio/mean": float((ratio.detach() * mask).sum() / mask.sum()),
        }
