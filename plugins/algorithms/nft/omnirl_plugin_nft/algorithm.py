"""DiffusionNFT over the flow-model contract: negative-aware fine-tuning on the forward process.

No log-probs and no SDE: the rollout samples with the *sampler policy* (an EMA of the trained weights,
swapped in around the rollout by ``rollout_policy``) and a deterministic ODE. Each sample's reward becomes an
optimality probability r = 0.5 + 0.5 * clip(A, -c, c) / c with A = (r_raw - group mean) / std and c =
``adv_clip``: 5 (the default) is NVlabs' trainer (clip(A, -5, 5) / 5 / 2 + 0.5, i.e. the paper's formula with
Z = 5 std), 1 the paper's r = 0.5 + 0.5 * clip(A, -1, 1) (Z = std). Training draws eps and a level
s for each clean latent x0, x_s = (1 - s) x0 + s eps, and with v_old the sampler policy's velocity (frozen)
and v the current one:
  v+ = (1 - beta) v_old + beta v,   v- = (1 + beta) v_old - beta v
  L = r * ||v+ - (eps - x0)||^2 + (1 - r) * ||v- - (eps - x0)||^2    (mean over dims)
so good samples pull the implicit positive policy towards them and bad ones push the negative one. The
reference project measures the errors in x0-space (x0_hat = x_s - s v), each divided by its detached mean
absolute error (adaptive weighting), and scales the loss by 1 / beta; both are options here.

Sampler policy: old <- lam * old + (1 - lam) * theta before each rollout, lam = min(ema_max,
ema_rate * (k - ema_delay)) for k > ema_delay else 0 (k = updates so far): ema_max 0 copies the policy
(on-policy), ema_rate 0.001 / ema_max 0.5 is a linear ramp, ema_delay 75 with ema_max 0.999 a delayed one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.algorithm import Algorithm
from omnirl_core.config import RunConfig
from omnirl_core.contracts import Conditioning, RolloutPlan, Sample, TrainingUnit
from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.flow.batching import grouped_velocity
from omnirl_core.flow.sampler import mean_over_dims, noised, training_sigmas, velocity_target
from omnirl_core.rl.advantage import group_advantages
from omnirl_core.rl.ema import ShadowParameters


class NFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = Field(1.0, gt=0, description="Guidance strength beta of the implicit policies (1.0; 0.1 for OCR).")
    global_std: bool = Field(True, description="Z: the batch std of the rewards (True) or each group's std.")
    adv_clip: float = Field(
        5.0, gt=0, description="Optimality r = 0.5 + 0.5 * clip(A, -adv_clip, adv_clip) / adv_clip, A the reward's "
        "advantage (r_raw - group mean) / std: 5 is NVlabs' trainer (r = 0.5 + A / 10, within [0.3, 0.7] while "
        "|A| <= 2), 1 the paper's formula (Z = std, r spans [0, 1])."
    )
    loss_space: Literal["x0-adaptive", "velocity"] = Field(
        "x0-adaptive", description="'x0-adaptive': x0-space errors over their detached mean abs error (the "
        "reference project); 'velocity': the velocity-space squared errors of the paper's formula."
    )
    scale_by_beta: bool = Field(True, description="Divide the loss by beta (the reference project does).")
    kl_weight: float = Field(
        0.0, ge=0, description="Weight of a velocity-MSE to the base model (1e-4 in some reference runs; 0: off)."
    )
    timesteps_per_sample: int = Field(1, ge=1, description="(eps, s) draws per sample per step.")
    sigma_sampling: Literal["uniform", "logit-normal"] = Field("uniform", description="Distribution of s.")
    sigma_min: float = Field(0.0, ge=0, lt=1, description="Smallest training s.")
    sigma_max: float = Field(1.0, gt=0, le=1, description="Largest training s.")
    ema_max: float = Field(0.5, ge=0, le=1, description="Largest EMA decay lam of the sampler policy (0: copy).")
    ema_rate: float = Field(0.001, ge=0, description="lam grows by this much per update.")
    ema_delay: int = Field(0, ge=0, description="Updates during which lam stays 0 (the sampler copies the policy).")
    ode_solver: Literal["ode", "dpm2"] = Field(
        "ode", description="Deterministic rollout solver: Euler, or second-order DPM-Solver++(2M)."
    )


@dataclass
class NFTUnit(TrainingUnit):
    """One (eps, s) draw on one rollout sample's clean latent."""

    sample: ClassVar[None] = None  # a unit of no single sample

    x0: torch.Tensor
    eps: torch.Tensor
    sigma: torch.Tensor  # () fp32
    optimality: float  # r in [0, 1]
    cond: Conditioning
    v_old: torch.Tensor | None = None
    v_ref: torch.Tensor | None = None


def optimality(rewards: torch.Tensor, groups: torch.Tensor, global_std: bool, *, clip: float,
               eps: float = 1e-8) -> torch.Tensor:
    """r = 0.5 + 0.5 * clip(A, -clip, clip) / clip, A = (r_raw - group mean) / std, std the batch's or the group's
    (population): the paper's 0.5 + 0.5 clip((r_raw - mean) / Z, -1, 1) with Z = clip x std."""
    adv = group_advantages(rewards, groups, global_std=global_std, eps=eps, clip=clip)
    return 0.5 + 0.5 * adv / clip


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor,
             r: torch.Tensor, beta: float, space: str = "velocity") -> torch.Tensor:
    """Per sample: r * err(v+) + (1 - r) * err(v-), err in velocity space or adaptive x0 space."""
    v_plus = (1.0 - beta) * v_old + beta * v
    v_minus = (1.0 + beta) * v_old - beta * v
    target = velocity_target(x0, eps)
    if space == "velocity":
        pos = mean_over_dims((v_plus - target) ** 2)
        neg = mean_over_dims((v_minus - target) ** 2)
    else:
        x_s = noised(x0, eps, sigma)
        sb = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
        pos = _adaptive(x_s - sb * v_plus, x0)
        neg = _adaptive(x_s - sb * v_minus, x0)
    return r * pos + (1.0 - r) * neg


def _adaptive(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Squared x0 error divided by its own detached mean absolute error (scale-free per sample)."""
    err = x0_hat - x0.float()
    weight = mean_over_dims(err.detach().abs()).clamp(min=1e-5)
    return mean_over_dims(err**2) / weight


class DiffusionNFT(Algorithm):
    reference_fields = ("v_ref",)

    def __init__(self, options: NFTConfig | None, config: RunConfig):
        super().__init__(options or NFTConfig(), config)
        o = self.options
        self.uses_reference = o.kl_weight > 0
        if o.sigma_min >= o.sigma_max:
            raise ConfigError(f"NFT sigma_min {o.sigma_min} must be below sigma_max {o.sigma_max}.")
        self.sampler_policy: ShadowParameters | None = None
        self.updates = 0  # optimizer updates folded into the sampler policy
        kinds = (o.ode_solver,) * config.rollout.num_steps
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=())

    def decay(self, updates: int) -> float:
        o = self.options
        if updates <= o.ema_delay:
            return 0.0
        return min(o.ema_max, o.ema_rate * (updates - o.ema_delay))

    # -- rollout with the sampler policy --------------------------------------------------------
    def _sampler(self, model: Any) -> ShadowParameters:
        if self.sampler_policy is None:
            self.sampler_policy = ShadowParameters(model.trainable_parameters())
        return self.sampler_policy

    def after_update(self, model: Any) -> None:
        """Called by the actor after each optimizer update: fold it into the EMA sampler policy."""
        sampler = self._sampler(model)
        self.updates += 1
        sampler.update(self.decay(self.updates))

    @contextmanager
    def rollout_policy(self, model: Any) -> Iterator[None]:
        """Around each rollout in the actor's process (colocated): sample with the EMA weights."""
        if model is None:
            raise UsageError("DiffusionNFT rolls out with its EMA sampler policy and needs a model.")
        with self._sampler(model).swapped():
            yield

    @contextmanager
    def sync_policy(self, model: Any) -> Iterator[None]:
        """Around the export of the weights a separate rollout worker receives: the EMA weights, since the
        rollout samples with the sampler policy (split placement)."""
        with self._sampler(model).swapped():
            yield

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.tensor([s.request.group for s in samples])
        r = optimality(rewards, groups, self.options.global_std, clip=self.options.adv_clip)
        for sample, value in zip(samples, r.tolist()):
            sample.advantage = value
        return {"nft/optimality_mean": float(r.mean()), "nft/optimality_abs_dev": float((r - 0.5).abs().mean())}

    def training_units(self, samples: list[Sample]) -> list[NFTUnit]:
        o = self.options
        units = []
        for sample in samples:
            x0 = sample.latents[-1].float()
            gen = torch.Generator().manual_seed(sample.request.seed + 7)
            for _ in range(o.timesteps_per_sample):
                eps = torch.randn(x0.shape, generator=gen, dtype=torch.float32)
                s = training_sigmas(1, gen, o.sigma_sampling, o.sigma_min, o.sigma_max)[0]
                units.append(NFTUnit(x0=x0, eps=eps, sigma=s, optimality=sample.advantage,
                                     cond=sample.cond))
        return units

    # -- update --------------------------------------------------------------------------------
    def _velocity(self, model: Any, units: list[NFTUnit]) -> torch.Tensor:
        device = getattr(model, "device", torch.device("cpu"))
        x0 = torch.stack([u.x0 for u in units]).to(device)
        eps = torch.stack([u.eps for u in units]).to(device)
        s = torch.stack([u.sigma for u in units]).to(device)
        # units of sources of other sizes (an editing model's) do not share one call
        return grouped_velocity(model, noised(x0, eps, s), s, [u.cond for u in units]).float()

    def reference_prepare(self, model: Any, units: list[NFTUnit]) -> None:
        """Without grad, ``model`` being the reference (base) policy: its velocities."""
        for u, v in zip(units, self._velocity(model, units)):
            u.v_ref = v.detach()

    def prepare(self, model: Any, units: list[NFTUnit]) -> dict[str, float]:
        """Without grad: the sampler policy's velocities (the base model's for the KL term come through
        ``reference_prepare``)."""
        sampler = self._sampler(model)
        with sampler.swapped():
            v_old = self._velocity(model, units)
        for u, v in zip(units, v_old):
            u.v_old = v.detach()
        return {"nft/ema_decay": self.decay(self.updates), "nft/sampler_lag_rms": sampler.distance()}

    def loss(self, model: Any, units: list[NFTUnit], first_update: bool = False):
        o = self.options
        v = self._velocity(model, units)
        device = v.device
        v_old = torch.stack([u.v_old for u in units]).to(device)
        x0 = torch.stack([u.x0 for u in units]).to(device)
        eps = torch.stack([u.eps for u in units]).to(device)
        s = torch.stack([u.sigma for u in units]).to(device)
        r = torch.tensor([u.optimality for u in units], device=device)
        per_unit = nft_loss(v, v_old, x0, eps, s, r, o.beta, "velocity" if o.loss_space == "velocity" else "x0")
        policy_loss = per_unit.mean() / (o.beta if o.scale_by_beta else 1.0)
        loss = policy_loss
        metrics = {"nft/policy_loss": float(policy_loss.detach())}
        if self.uses_reference:
            v_ref = torch.stack([u.v_ref for u in units]).to(device)
            kl = mean_over_dims((v - v_ref) ** 2).mean()
            loss = loss + o.kl_weight * kl
            metrics["kl"] = float(kl.detach())
        return loss, metrics

    # -- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Saved after a step's update: the updates folded into the EMA so far (the schedule's clock)."""
        return {"updates": self.updates}

    def load_state(self, state: dict[str, Any]) -> None:
        self.updates = int(state.get("updates", 0))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The EMA sampler policy's weights (the trained ones are in the checkpoint already)."""
        return self.sampler_policy.state_dict() if self.sampler_policy is not None else {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], model: Any) -> None:
        self._sampler(model).load_state_dict(tensors)
