"""The policy-gradient machinery every log-prob-based flow algorithm shares (FlowGRPO and its relatives).

An algorithm plugin subclasses ``FlowPolicyGradient`` and changes only what its paper changes: the
rollout plan (``plan``), the advantage (``assign_advantages``), which steps are trained
(``training_units``) or the per-transition objective (``surrogate``). Nothing here names a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.algorithm import Algorithm
from omnirl_core.config import RunConfig
from omnirl_core.contracts import Conditioning, FlowModel, RolloutPlan, Sample, TrainingUnit
from omnirl_core.flow.batching import grouped_velocity
from omnirl_core.flow.sampler import gaussian_kl, step_mean, transition_logprob
from omnirl_core.rl.advantage import assign_group_advantages
from omnirl_core.rl.correction import (
    record_deltas,
    rs_mask,
    sequence_diagnostics,
    sequence_log_weights,
    step_diagnostics,
)

RS_KEEP = "rs_keep"
"""``Transition.extras`` key: the RS mask (1.0 kept, 0.0 rejected) applied to the unit's loss."""

T = TypeVar("T")


def _present(value: T | None, what: str) -> T:
    """A field a flow transition must have by now (its sample's trajectory, a prepared log-prob or mean)."""
    assert value is not None, f"a flow transition without its {what}"
    return value


@dataclass
class Transition(TrainingUnit):
    """One trained step j of one sample: x_j -> x_{j+1}."""

    sample: Sample
    step: int
    old_logprob: torch.Tensor | None = None
    old_mean: torch.Tensor | None = None
    ref_mean: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def rollout_logprob(self) -> torch.Tensor:
        return _present(self.sample.logprobs, "rollout log-probs")[self.step]

    @property
    def kind(self) -> str:
        return self.sample.request.plan.step_kinds[self.step]


@dataclass
class TransitionBatch:
    x: torch.Tensor
    x_next: torch.Tensor
    s: torch.Tensor
    s_next: torch.Tensor
    sigma_max: torch.Tensor
    conds: list[Conditioning]
    """Each row's conditioning, as the rollout used it (condition-image latents included)."""
    unconds: list[Conditioning] | None
    guidance_scale: float


def stack_transitions(units: list[Transition], device: torch.device | str) -> TransitionBatch:
    """Batched inputs of the transitions (x_j, x_{j+1}, s_j, s_{j+1}) and each one's conditioning."""
    x = torch.stack([_present(u.sample.latents, "latents")[u.step] for u in units]).to(device)
    x_next = torch.stack([_present(u.sample.latents, "latents")[u.step + 1] for u in units]).to(device)
    s = torch.stack([_present(u.sample.sigmas, "sigmas")[u.step] for u in units]).to(device)
    s_next = torch.stack([_present(u.sample.sigmas, "sigmas")[u.step + 1] for u in units]).to(device)
    sigma_max = torch.stack([_present(u.sample.sigmas, "sigmas")[1] for u in units]).to(device)
    conds = [_present(u.sample.cond, "conditioning") for u in units]
    scale = units[0].sample.request.guidance_scale
    unconds = None
    if scale > 1.0:
        unconds = [_present(u.sample.uncond, "unconditional conditioning") for u in units]
    return TransitionBatch(x, x_next, s, s_next, sigma_max, conds, unconds, scale)


def transition_stats(model: FlowModel, units: list[Transition],
                     eta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TransitionBatch]:
    """(mean, std, logp, batch) of the stored transitions under the model's current weights.

    All units of one call share a sampler kind (the trainer's micro-batches come from one plan). Units whose
    conditionings do not concatenate (condition images of other sizes) take one ``velocity`` call each group."""
    kind = units[0].kind
    batch = stack_transitions(units, model.device)
    v = grouped_velocity(model, batch.x, batch.s, batch.conds, batch.guidance_scale, batch.unconds)
    mean, std = step_mean(kind, batch.x, v, batch.s, batch.s_next, eta, batch.sigma_max)
    return mean, std, transition_logprob(kind, batch.x_next, mean, std), batch


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO: max(-A rho, -A clip(rho, 1 - e, 1 + e)), per transition."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip))


class FlowPolicyGradientOptions(BaseModel):
    """The options ``FlowPolicyGradient`` reads; an algorithm's options subclass it, add their own, and override a
    default where theirs differs."""

    model_config = ConfigDict(extra="forbid")
    noise_level: float = Field(0.7, gt=0, description="eta: the noise level of the stochastic (trained) steps.")
    clip_range: float = Field(1e-4, gt=0, description="PPO clip e on the ratio.")
    beta: float = Field(0.0, ge=0, description="KL weight to the reference (base model); 0 turns it off.")
    adv_clip: float = Field(5.0, gt=0, description="Advantages are clipped to [-adv_clip, adv_clip].")
    global_std: bool = Field(False, description="Normalise advantages by the batch std (True) or per group.")


class FlowPolicyGradient(Algorithm[FlowModel, Transition]):
    """FlowGRPO's structure: group advantages, one unit per trained step, the clipped surrogate and the exact KL to
    the reference. Its options are a ``FlowPolicyGradientOptions``."""

    options: FlowPolicyGradientOptions

    reference_fields = ("ref_mean",)
    controller_reads_trajectory = False  # advantages from rewards, units are (sample, step) references

    needs_old_mean = False
    """A subclass whose objective uses the pre-update transition means (GRPO-Guard) sets this: ``prepare``
    then computes them in bypass mode too."""

    def __init__(self, options: FlowPolicyGradientOptions, config: RunConfig):
        super().__init__(options, config)
        self.uses_reference = options.beta > 0
        self.num_steps = config.rollout.num_steps

    # -- rollout -------------------------------------------------------------------------------
    def plan(self, step: int) -> RolloutPlan:
        raise NotImplementedError

    # -- advantages ----------------------------------------------------------------------------
    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        adv = assign_group_advantages(samples, global_std=self.options.global_std, clip=self.options.adv_clip,
                                     rewards=self.config.rewards)
        return {"advantage/abs_mean": float(adv.abs().mean())}

    def training_units(self, samples: list[Sample]) -> list[Transition]:
        return [Transition(s, j) for s in samples for j in s.request.plan.train_steps]

    # -- update --------------------------------------------------------------------------------
    def prepare(self, model: FlowModel, units: list[Transition]) -> dict[str, float]:
        """Without grad, before the update: old log-probs (recompute mode)."""
        metrics: dict[str, float] = {}
        eta = units[0].sample.request.plan.eta
        if self.recompute or self.needs_old_mean:
            mean, _, logp, _ = transition_stats(model, units, eta)
            for u, lp, m in zip(units, logp, mean):
                u.old_mean = m.detach()
                if self.recompute:
                    u.old_logprob = lp.detach()
            if self.recompute:
                # rollout correction: the trainer-vs-rollout mismatch of every step, before any update
                metrics.update(step_diagnostics(record_deltas(units, logp)))
        return metrics

    def reference_prepare(self, model: FlowModel, units: list[Transition]) -> None:
        """Without grad, ``model`` being the reference policy: its transition means."""
        ref_mean, _, _, _ = transition_stats(model, units, units[0].sample.request.plan.eta)
        for u, m in zip(units, ref_mean):
            u.ref_mean = m.detach()

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, units: list[Transition],
                  mean: torch.Tensor, std: torch.Tensor,
                  batch: TransitionBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-transition policy loss (N,) and metrics. FlowGRPO: the clipped ratio."""
        ratio = torch.exp(logp - old)
        clip = self.options.clip_range
        return clipped_surrogate(ratio, adv, clip), {
            "clip_frac": float(((ratio - 1.0).abs() > clip).float().mean()),
            "ratio/mean": float(ratio.detach().mean()),
        }

    def loss(self, model: FlowModel, units: list[Transition], first_update: bool = False,
             correction: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of a micro-batch (mean over its units) and metrics.

        Rollout correction: a sample whose sequence IS weight leaves ``train.rs_band`` is rejected whole
        (loss weight 0); the mask applied to each unit is remembered. ``correction=True`` (bypass mode,
        after the minibatch, see ``finish_minibatch``): re-evaluates units whose sample's mask changed once
        all its steps were seen and returns (final - applied mask) x their policy loss, nothing else."""
        eta = units[0].sample.request.plan.eta
        mean, std, logp, batch = transition_stats(model, units, eta)
        rollout = torch.stack([u.rollout_logprob for u in units]).to(logp.device)
        old = (torch.stack([_present(u.old_logprob, "old log-prob") for u in units]).to(logp.device)
               if self.recompute else rollout)
        adv = torch.tensor([u.sample.advantage for u in units], device=logp.device)
        if not self.recompute and not correction:
            delta = record_deltas(units, logp, overwrite=False)
        keep = rs_mask(sequence_log_weights(units, self.config.train.rs_aggregate), self.config.train.rs_band)
        per_unit, metrics = self.surrogate(logp, old, adv, units, mean, std, batch)
        if correction:
            # a unit this process never applied a mask to (a sharded engine's zero-weight filler) changes nothing
            applied = torch.tensor([u.extras.get(RS_KEEP, k) for u, k in zip(units, keep.tolist())])
            for u, k in zip(units, keep.tolist()):
                u.extras[RS_KEEP] = k
            return (per_unit * (keep - applied).to(logp.device)).mean(), {}
        for u, k in zip(units, keep.tolist()):
            u.extras[RS_KEEP] = k
        policy_loss = (per_unit * keep.to(logp.device)).mean()
        metrics["policy_loss"] = float(policy_loss.detach())
        loss = policy_loss
        if self.uses_reference:
            kl = self.transition_kl(units, mean, std, batch).mean()
            loss = loss + self.options.beta * kl
            metrics["kl"] = float(kl.detach())
        else:
            metrics["kl"] = 0.0
        if first_update and not self.recompute:
            metrics.update(step_diagnostics(delta))
        return loss, metrics

    def transition_kl(self, units: list[Transition], mean: torch.Tensor, std: torch.Tensor,
                      batch: TransitionBatch) -> torch.Tensor:
        """The KL term of each transition (N,) that ``beta`` multiplies: the exact KL between the policy's and
        the reference's Gaussian transitions (equal std), closed form. An algorithm may weigh it otherwise
        (FlowGRPO's ``kl_convention``)."""
        ref_mean = torch.stack([_present(u.ref_mean, "reference mean") for u in units]).to(mean.device)
        return gaussian_kl(mean, ref_mean, std)

    def finish_minibatch(self, units: list[Transition]) -> tuple[list[Transition], dict[str, float]]:
        """After all micro-batches of a minibatch (whole samples): the sequence weights from every step of
        each sample, their diagnostics, and the units whose applied mask differs from the final one.

        Recompute mode: every delta was recorded in ``prepare``, so the masks were final from the start.
        Bypass mode: a unit's mask was decided from the steps of its sample seen so far; the engine re-runs
        the units returned here with ``loss(..., correction=True)`` before the optimizer step."""
        log_w = sequence_log_weights(units, self.config.train.rs_aggregate)
        keep = rs_mask(log_w, self.config.train.rs_band)
        fix = [u for u, k in zip(units, keep.tolist()) if u.extras.get(RS_KEEP, k) != k]
        return fix, sequence_diagnostics(units, log_w, keep)
