"""FlowGRPO over the flow-model contract (no model-specific code).

Rollout: Flow-SDE (or CPS) on the trained steps (all but the last by default, or a window: the fast
variant), ODE elsewhere. Advantage: (r - group mean) / (std + 1e-4), std global or per group, clipped.
Loss per trained step: max(-A rho, -A clip(rho, 1 - e, 1 + e)) + beta * KL(policy || reference), with
rho = exp(logp_theta - logp_old) and the KL in closed form between the two Gaussian transitions.

KL convention (README, "The KL coefficient"): omnirl's term is the exact KL between the policy's and the
reference's transitions, mean over latent elements of (mu - mu_ref)^2 / (2 std^2) with std = a_s sqrt(D). flow_grpo
divides by a_s^2 instead (its ``std_dev_t`` leaves out sqrt(D)), so its term is the exact one times D = s - s' on
every Flow-SDE step (equal on CPS steps, whose ``std_dev_t`` is the std). ``kl_convention: flow_grpo`` uses that
term, so that a beta copied from flow_grpo's configs acts as it does there.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.config import RunConfig
from omnirl_core.errors import ConfigError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient, Transition, TransitionBatch
from omnirl_core.flow.sampler import gaussian_kl
from omnirl_core.interfaces import RolloutPlan


class FlowGRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampler: Literal["sde", "cps"] = Field("sde", description="Stochastic sampler of the trained steps.")
    noise_level: float = Field(0.7, gt=0, description="eta: SDE noise level (0.7 SD3.5, 1.2 Qwen-Image; CPS 0.8).")
    clip_range: float = Field(1e-4, gt=0, description="PPO clip e on the ratio.")
    beta: float = Field(0.04, ge=0, description="KL weight to the reference (base model); 0 turns it off.")
    kl_convention: Literal["exact", "flow_grpo"] = Field(
        "exact", description="KL term that beta multiplies: exact (the Gaussian KL between the transitions) or "
        "flow_grpo (the exact KL times each Flow-SDE step's size s - s', as flow_grpo computes it; use it with a beta "
        "copied from flow_grpo). See the plugin README."
    )
    adv_clip: float = Field(5.0, gt=0, description="Advantages are clipped to [-adv_clip, adv_clip].")
    global_std: bool = Field(True, description="Normalise advantages by the batch std (True) or per group.")
    window: int | None = Field(
        None, ge=1, description="Fast variant: only this many consecutive steps are SDE and trained (None: all "
        "but the last step)."
    )
    window_start: int = Field(0, ge=0, description="First step of the window (fast variant).")


class FlowGRPO(FlowPolicyGradient):
    def __init__(self, options: FlowGRPOConfig | None, config: RunConfig):
        super().__init__(options or FlowGRPOConfig(), config)
        o = self.options
        if o.window is None:
            trained = tuple(range(max(self.num_steps - 1, 1)))
        else:
            if o.window_start + o.window > self.num_steps:
                raise ConfigError(
                    f"FlowGRPO window {o.window_start}..{o.window_start + o.window - 1} exceeds {self.num_steps} "
                    "steps.", hint="Lower algorithm.options.window / window_start, or raise rollout.num_steps.")
            trained = tuple(range(o.window_start, o.window_start + o.window))
        if o.sampler == "cps" and self.num_steps - 1 in trained:
            raise ConfigError("CPS adds no noise on the step to sigma 0: it cannot be trained.",
                              hint="End the window before the last step (window_start + window < num_steps).")
        kinds = tuple(o.sampler if i in trained else "ode" for i in range(self.num_steps))
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=trained, eta=o.noise_level)

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def transition_kl(self, units: list[Transition], mean: torch.Tensor, std: torch.Tensor,
                      batch: TransitionBatch) -> torch.Tensor:
        """The KL term of each transition (N,) in ``kl_convention``."""
        ref_mean = torch.stack([u.ref_mean for u in units]).to(mean.device)
        return kl_term(self.options.kl_convention, units[0].kind, mean, ref_mean, std, batch.s, batch.s_next)


def kl_term(convention: str, kind: str, mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor,
            s: torch.Tensor, s_next: torch.Tensor) -> torch.Tensor:
    """Per-transition KL term (N,) between the policy's and the reference's Gaussian transitions of equal std.

    exact: mean over latent elements of (mu - mu_ref)^2 / (2 std^2).
    flow_grpo: (mu - mu_ref)^2 / (2 std_dev_t^2) with flow_grpo's std_dev_t = a_s = std / sqrt(D) on Flow-SDE
    steps, i.e. exact x D with D = s - s'; on CPS steps std_dev_t is the std and the terms agree."""
    if convention not in ("exact", "flow_grpo"):
        raise ValueError(f"unknown KL convention {convention!r}; expected 'exact' or 'flow_grpo'")
    exact = gaussian_kl(mean, ref_mean, std)
    if convention == "flow_grpo" and kind == "sde":
        return exact * (s.float() - s_next.float())
    return exact
