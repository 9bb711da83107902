"""FlowGRPO over the flow-model contract (no model-specific code).

Rollout: Flow-SDE on the trained steps (all but the last by default, or a window), ODE elsewhere.
Advantage: (r - group mean) / (std + 1e-4), std global or per group, clipped to [-5, 5].
Loss per trained step: max(-A rho, -A clip(rho, 1 - e, 1 + e)) + beta * KL(policy || reference), with
rho = exp(logp_theta - logp_old) and the KL in closed form between the two Gaussian transitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.advantage import group_advantages
from omnirl_core.config import RunConfig
from omnirl_core.interfaces import Conditioning, RolloutPlan, Sample
from omnirl_core.sampler import gaussian_kl, step_mean, transition_logprob


class FlowGRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampler: Literal["sde", "cps"] = Field("sde", description="Stochastic sampler of the trained steps.")
    noise_level: float = Field(0.7, ge=0, description="eta: SDE noise level (0.7 SD3.5, 1.2 Qwen-Image; CPS 0.8).")
    clip_range: float = Field(1e-4, gt=0, description="PPO clip e on the ratio.")
    beta: float = Field(0.04, ge=0, description="KL weight to the reference (base model); 0 turns it off.")
    adv_clip: float = Field(5.0, gt=0, description="Advantages are clipped to [-adv_clip, adv_clip].")
    global_std: bool = Field(True, description="Normalise advantages by the batch std (True) or per group.")
    window: int | None = Field(
        None, ge=1, description="Fast variant: only this many consecutive steps are SDE and trained (None: all "
        "but the last step)."
    )
    window_start: int = Field(0, ge=0, description="First step of the window (fast variant).")


@dataclass
class Transition:
    """One trained step j of one sample: x_j -> x_{j+1}."""

    sample: Sample
    step: int
    old_logprob: torch.Tensor | None = None
    ref_mean: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def rollout_logprob(self) -> torch.Tensor:
        return self.sample.logprobs[self.step]


def stack_transitions(units: list[Transition], device: torch.device):
    """Batched tensors of the transitions' inputs (x_j, x_{j+1}, s_j, s_{j+1}, conditioning)."""
    x = torch.stack([u.sample.latents[u.step] for u in units]).to(device)
    x_next = torch.stack([u.sample.latents[u.step + 1] for u in units]).to(device)
    s = torch.stack([u.sample.sigmas[u.step] for u in units]).to(device)
    s_next = torch.stack([u.sample.sigmas[u.step + 1] for u in units]).to(device)
    sigma_max = torch.stack([u.sample.sigmas[1] for u in units]).to(device)
    cond = Conditioning.cat([u.sample.extras["cond"] for u in units]).to(device)
    uncond = None
    if units[0].sample.request.guidance_scale > 1.0:
        uncond = Conditioning.cat([u.sample.extras["uncond"] for u in units]).to(device)
    return x, x_next, s, s_next, sigma_max, cond, uncond


def transition_stats(model: Any, units: list[Transition], kind: str, eta: float):
    """(mean, std, logp) of the stored transitions under the model's current weights."""
    device = getattr(model, "device", torch.device("cpu"))
    x, x_next, s, s_next, sigma_max, cond, uncond = stack_transitions(units, device)
    v = model.velocity(x, s, cond, units[0].sample.request.guidance_scale, uncond)
    mean, std = step_mean(kind, x, v, s, s_next, eta, sigma_max)
    return mean, std, transition_logprob(kind, x_next, mean, std)


class FlowGRPO:
    def __init__(self, options: FlowGRPOConfig | None, config: RunConfig):
        self.options = options or FlowGRPOConfig()
        self.config = config
        self.uses_reference = self.options.beta > 0
        self.num_steps = config.rollout.num_steps
        o = self.options
        if o.window is None:
            trained = tuple(range(max(self.num_steps - 1, 1)))
        else:
            if o.window_start + o.window > self.num_steps:
                raise ValueError(
                    f"window {o.window_start}..{o.window_start + o.window - 1} exceeds {self.num_steps} steps"
                )
            trained = tuple(range(o.window_start, o.window_start + o.window))
        kinds = tuple(o.sampler if i in trained else "ode" for i in range(self.num_steps))
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=trained, eta=o.noise_level)

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.tensor([s.request.group for s in samples])
        adv = group_advantages(rewards, groups, global_std=self.options.global_std, clip=self.options.adv_clip)
        for sample, a in zip(samples, adv.tolist()):
            sample.advantage = a
        return {"advantage/abs_mean": float(adv.abs().mean())}

    def training_units(self, samples: list[Sample]) -> list[Transition]:
        return [Transition(s, j) for s in samples for j in s.request.plan.train_steps]

    def prepare(self, model: Any, units: list[Transition]) -> dict[str, float]:
        """Old log-probs (recompute mode) and the reference means for the KL; no grad."""
        metrics: dict[str, float] = {}
        kind, eta = self._plan.step_kinds[units[0].step], self._plan.eta
        if self.config.train.old_logprob == "recompute":
            _, _, logp = transition_stats(model, units, kind, eta)
            rollout = torch.stack([u.rollout_logprob for u in units]).to(logp.device)
            delta = (logp - rollout).abs()
            for u, lp in zip(units, logp):
                u.old_logprob = lp.detach()
            metrics["logprob/abs_delta_mean"] = float(delta.mean())
            metrics["logprob/abs_delta_max"] = float(delta.max())
        if self.uses_reference:
            with model.reference():
                ref_mean, _, _ = transition_stats(model, units, kind, eta)
            for u, m in zip(units, ref_mean):
                u.ref_mean = m.detach()
        return metrics

    def loss(self, model: Any, units: list[Transition], first_update: bool = False):
        o = self.options
        kind, eta = self._plan.step_kinds[units[0].step], self._plan.eta
        mean, std, logp = transition_stats(model, units, kind, eta)
        rollout = torch.stack([u.rollout_logprob for u in units]).to(logp.device)
        if self.config.train.old_logprob == "recompute":
            old = torch.stack([u.old_logprob for u in units]).to(logp.device)
        else:
            old = rollout
        adv = torch.tensor([u.sample.advantage for u in units], device=logp.device)
        ratio = torch.exp(logp - old)
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - o.clip_range, 1.0 + o.clip_range)
        policy_loss = torch.maximum(unclipped, clipped).mean()
        metrics = {
            "policy_loss": float(policy_loss.detach()),
            "clip_frac": float(((ratio - 1.0).abs() > o.clip_range).float().mean()),
            "ratio/mean": float(ratio.detach().mean()),
        }
        loss = policy_loss
        if self.uses_reference:
            ref_mean = torch.stack([u.ref_mean for u in units]).to(mean.device)
            kl = gaussian_kl(mean, ref_mean, std).mean()
            loss = loss + o.beta * kl
            metrics["kl"] = float(kl.detach())
        else:
            metrics["kl"] = 0.0
        if first_update and self.config.train.old_logprob == "bypass":
            delta = (logp.detach() - rollout).abs()
            metrics["logprob/abs_delta_mean"] = float(delta.mean())
            metrics["logprob/abs_delta_max"] = float(delta.max())
        return loss, metrics
