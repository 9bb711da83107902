"""FlowGRPO over the flow-model contract (no model-specific code).

Rollout: Flow-SDE (or CPS) on the trained steps (all but the last by default, or a window: the fast
variant), ODE elsewhere. Advantage: (r - group mean) / (std + 1e-4), std global or per group, clipped.
Loss per trained step: max(-A rho, -A clip(rho, 1 - e, 1 + e)) + beta * KL(policy || reference), with
rho = exp(logp_theta - logp_old) and the KL in closed form between the two Gaussian transitions.

KL convention (README, "The KL coefficient"): omnirl's term is the exact KL between the policy's and the
reference's transitions, mean over latent elements of (mu - mu_ref)^2 / (2 std^2) with std = a_s sqrt(D). flow_grpo
divides by a_s^2 instead (its ``std_dev_t`` leaves out sqrt(D)), so its term is the exact one times D = s - s' on
every Flow-SDE step (equal on CPS steps, whose ``std_dev_t`` is the std). ``kl_convention: flow_grpo`` uses that
term, so that a beta copied from flow_grpo's configs acts as it does there. ``kl_reduction`` says how the term
reduces over the latent elements: the mean (flow_grpo's, and omnirl's default: beta does not depend on the
resolution) or the sum (the KL of whole transitions in nats).

EMA (``ema: true``, flow_grpo's ``train.ema``): a moving average of the trained weights (the LoRA adapters, or
every trained parameter), starting from the initial weights. A fold with clock k (optimizer steps so far) and
the weights theta as they are then, when (k + 1) is a multiple of ``ema_interval``: ema <- d ema + (1 - d) theta
with d = min(ema_decay, (1 + k) / (10 + k)) (flow_grpo's ``EMAModuleWrapper.step``). ``ema_step: update`` folds
once after each optimizer step. ``ema_step: microbatch`` folds as flow_grpo's train_sd3.py does: after each of
its micro-batches (``train.batch_size`` samples through every trained step), so G times per optimizer step with
G accumulated micro-batches, the first G - 1 with the weights and clock of the previous optimizer step and the
last after the step. Here a micro-batch of that kind is ``train.micro_batch_size`` samples (the recipes map
flow_grpo's batch of b samples to micro-batches of b transitions), so G = ceil(m / T) with m the micro-batches
this rank ran for the optimizer step (``loss`` calls) and T the trained steps per sample. The EMA is
what the run evaluates (``run.eval_every``) and what checkpoints offer for use (``eval-weights/``, loaded by
``omnirl eval`` / ``omnirl sample``); the rollout and the update use the trained weights, and a resume restores both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import RunConfig
from omnirl_core.contracts import RolloutPlan
from omnirl_core.errors import ConfigError
from omnirl_core.flow.policy_gradient import (
    FlowPolicyGradient,
    FlowPolicyGradientOptions,
    Transition,
    TransitionBatch,
)
from omnirl_core.flow.sampler import gaussian_kl
from omnirl_core.rl.ema import ShadowParameters


class FlowGRPOConfig(FlowPolicyGradientOptions):
    sampler: Literal["sde", "cps"] = Field("sde", description="Stochastic sampler of the trained steps.")
    beta: float = Field(0.04, ge=0, description="KL weight to the reference (base model); 0 turns it off.")
    kl_convention: Literal["exact", "flow_grpo"] = Field(
        "exact", description="KL term that beta multiplies: exact (the Gaussian KL between the transitions) or "
        "flow_grpo (the exact KL times each Flow-SDE step's size s - s', as flow_grpo computes it; use it with a beta "
        "copied from flow_grpo). See the plugin README."
    )
    kl_reduction: Literal["mean", "sum"] = Field(
        "mean", description="How the KL term reduces over the latent elements: mean (flow_grpo's; beta independent "
        "of the resolution) or sum (the KL of whole transitions, in nats)."
    )
    ema: bool = Field(False, description="Keep an EMA of the trained weights (flow_grpo's train.ema): evaluated "
                      "during training and saved in checkpoints' eval-weights/ for omnirl eval and sample.")
    ema_decay: float = Field(0.9, ge=0, lt=1, description="EMA decay cap (flow_grpo: 0.9); the decay at optimizer "
                             "step k is min(ema_decay, (1 + k) / (10 + k)).")
    ema_interval: int = Field(8, ge=1, description="Fold the weights into the EMA after optimizer step k when k + 1 "
                              "is a multiple of this (flow_grpo: 8).")
    ema_step: Literal["update", "microbatch"] = Field(
        "update", description="How often the EMA is folded: update, once per optimizer step; microbatch, once per "
        "micro-batch of micro_batch_size samples (each through every trained step) as flow_grpo's train_sd3.py "
        "does, i.e. its gradient-accumulation count per optimizer step. See the plugin README."
    )
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
        if o.ema and o.ema_step == "microbatch" and config.train.micro_batch_size == "auto":
            raise ConfigError(
                "FlowGRPO's ema_step: microbatch folds the EMA once per micro-batch, so the micro-batch size is part "
                "of its math, and train.micro_batch_size is 'auto' (chosen from the memory plan).",
                hint="Set train.micro_batch_size to a number (flow_grpo's train.batch_size x its trained steps per "
                "sample), or use algorithm.options.ema_step=update.")
        kinds = tuple(o.sampler if i in trained else "ode" for i in range(self.num_steps))
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=trained, eta=o.noise_level)
        self.has_eval_policy = o.ema
        self.ema_weights: ShadowParameters | None = None
        self.optimizer_steps = 0  # the EMA's clock (checkpointed)
        self.microbatches = 0  # loss calls since the last minibatch ended (0 between steps: never checkpointed)

    def plan(self, step: int) -> RolloutPlan:
        return self._plan

    def transition_kl(self, units: list[Transition], mean: torch.Tensor, std: torch.Tensor,
                      batch: TransitionBatch) -> torch.Tensor:
        """The KL term of each transition (N,) in ``kl_convention`` and ``kl_reduction``."""
        ref_mean = torch.stack([u.ref_mean for u in units]).to(mean.device)
        return kl_term(self.options.kl_convention, units[0].kind, mean, ref_mean, std, batch.s, batch.s_next,
                       self.options.kl_reduction)

    # -- EMA of the trained weights --------------------------------------------------------------
    def _ema(self, model: Any) -> ShadowParameters:
        if self.ema_weights is None:  # first use: before the first optimizer step, so it starts at theta_0
            self.ema_weights = ShadowParameters(model.trainable_parameters())
        return self.ema_weights

    def ema_decay(self, k: int) -> float:
        """The decay at optimizer step ``k`` (from 1): flow_grpo's warm-up, capped at ``ema_decay``."""
        return min(self.options.ema_decay, (1 + k) / (10 + k))

    def _fold(self, ema: ShadowParameters, times: int = 1) -> None:
        """``times`` EMA steps with the current clock and weights (flow_grpo's ``ema.step(params, step)``)."""
        k = self.optimizer_steps
        if (k + 1) % self.options.ema_interval == 0:
            for _ in range(times):
                ema.update(self.ema_decay(k))

    def loss(self, model: Any, units: list[Transition], first_update: bool = False, correction: bool = False):
        if self.options.ema:
            self._ema(model)
            if not correction:
                self.microbatches += 1
        loss, metrics = super().loss(model, units, first_update, correction)
        if self.options.ema and first_update:
            metrics["flowgrpo/ema_lag_rms"] = self._ema(model).distance()
        return loss, metrics

    def finish_minibatch(self, units: list[Transition]) -> tuple[list[Transition], dict[str, float]]:
        """Before the minibatch's optimizer step. ``ema_step: microbatch``: the folds of all but the last of its
        flow_grpo-sized micro-batches (G - 1), with the weights and clock of the previous optimizer step."""
        if self.options.ema and self.options.ema_step == "microbatch" and self.ema_weights is not None:
            flow_grpo_microbatches = -(-self.microbatches // len(self._plan.train_steps))
            self._fold(self.ema_weights, max(flow_grpo_microbatches - 1, 0))
        self.microbatches = 0
        return super().finish_minibatch(units)

    def after_optimizer_step(self, model: Any) -> None:
        if not self.options.ema:
            return
        self.optimizer_steps += 1
        self._fold(self._ema(model))  # update: the step's one fold; microbatch: that of its last micro-batch

    def eval_policy(self, model: Any) -> Any:
        return self._swapped(model) if self.options.ema else nullcontext()

    @contextmanager
    def _swapped(self, model: Any) -> Iterator[None]:
        with self._ema(model).swapped():
            yield

    def state(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps} if self.options.ema else {}

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.ema_weights.state_dict() if self.options.ema and self.ema_weights is not None else {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], model: Any) -> None:
        if self.options.ema:
            self._ema(model).load_state_dict(tensors)


def kl_term(convention: str, kind: str, mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor,
            s: torch.Tensor, s_next: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Per-transition KL term (N,) between the policy's and the reference's Gaussian transitions of equal std.

    exact: mean over latent elements of (mu - mu_ref)^2 / (2 std^2).
    flow_grpo: (mu - mu_ref)^2 / (2 std_dev_t^2) with flow_grpo's std_dev_t = a_s = std / sqrt(D) on Flow-SDE
    steps, i.e. exact x D with D = s - s'; on CPS steps std_dev_t is the std and the terms agree.
    ``reduction`` sum: times the number of latent elements of a transition (the KL of the whole transition)."""
    if convention not in ("exact", "flow_grpo"):
        raise ValueError(f"unknown KL convention {convention!r}; expected 'exact' or 'flow_grpo'")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"unknown KL reduction {reduction!r}; expected 'mean' or 'sum'")
    term = gaussian_kl(mean, ref_mean, std)
    if convention == "flow_grpo" and kind == "sde":
        term = term * (s.float() - s_next.float())
    if reduction == "sum":
        term = term * (mean[0].numel() if mean.dim() > 1 else 1)
    return term
