"""MixGRPO over the flow-model contract (Li et al., 2025; written from the paper).

Mixed ODE-SDE rollout: at training step k a window W_k = [l, l + w) of consecutive denoising steps uses the
SDE (with log-probs) and is trained; every other step is a deterministic ODE step and is not trained. The
objective on the window is FlowGRPO's clipped ratio (the shared ``FlowPolicyGradient``), so sampling noise
and training cost scale with w / N instead of 1.

Window schedules: ``progressive`` moves l forward by ``window_stride`` every ``window_shift_interval``
training steps, from ``window_min_start`` to ``window_max_start``, then starts over; ``random`` draws l
afresh each step from (run seed, step), the same on every rank; ``frozen`` keeps l = ``window_min_start``.

Flash: after the window nothing is trained, so the ODE there may take fewer, larger steps with a
second-order solver (DPM-Solver++(2M)): every ``flash_compression`` steps of the schedule become one.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from omnirl_core.config import RunConfig
from omnirl_core.contracts import RolloutPlan
from omnirl_core.errors import ConfigError
from omnirl_core.flow.policy_gradient import FlowPolicyGradient, FlowPolicyGradientOptions


class MixGRPOConfig(FlowPolicyGradientOptions):
    sampler: Literal["dance", "sde", "cps"] = Field(
        "sde", description="SDE of the window steps: 'sde' (Flow-SDE at eta 0.7, as the paper's released training "
        "scripts run MixGRPO), 'dance' (Dance-SDE, DanceGRPO's), 'cps'."
    )
    window_size: int = Field(4, ge=1, description="w: consecutive SDE steps that are trained (4 of 25 in the paper).")
    window_schedule: Literal["progressive", "random", "frozen"] = Field(
        "progressive", description="How the window start l moves over training."
    )
    window_stride: int = Field(1, ge=1, description="Progressive: steps l advances at each shift.")
    window_shift_interval: int = Field(25, ge=1, description="Progressive: training steps between shifts (tau).")
    window_min_start: int = Field(0, ge=0, description="Smallest window start l.")
    window_max_start: int | None = Field(
        None, ge=0, description="Largest window start l (None: num_steps - window_size); progressive rolls back "
        "to window_min_start after it."
    )
    shared_initial_noise: bool = Field(
        True, description="All samples of a group start from the same noise (as in DanceGRPO, which MixGRPO builds "
        "on): with ODE steps outside the window, a group's rewards then differ only through the window's noise."
    )
    flash: bool = Field(False, description="MixGRPO-Flash: second-order ODE (DPM-Solver++(2M)) after the window.")
    flash_compression: int = Field(
        2, ge=1, description="Flash: schedule steps after the window merged into one solver step."
    )


def window_start(options: MixGRPOConfig, num_steps: int, step: int, seed: int) -> int:
    """l at training step ``step`` (1-based), within [window_min_start, window_max_start]."""
    low = options.window_min_start
    high = num_steps - options.window_size if options.window_max_start is None else options.window_max_start
    if options.window_schedule == "frozen":
        return low
    if options.window_schedule == "random":
        return random.Random(seed * 1_000_003 + step).randint(low, high)
    shifts = (step - 1) // options.window_shift_interval
    positions = (high - low) // options.window_stride + 1  # past the last one the window rolls back to low
    return low + options.window_stride * (shifts % positions)


def mixed_plan(options: MixGRPOConfig, num_steps: int, start: int) -> RolloutPlan:
    """SDE and trained on [start, start + w); Euler before; Euler (or Flash's compressed 2M) after."""
    end = start + options.window_size
    window = tuple(range(start, end))
    after = "dpm2" if options.flash else "ode"
    if not options.flash or options.flash_compression == 1:
        kinds = tuple(options.sampler if i in window else (after if i >= end else "ode") for i in range(num_steps))
        return RolloutPlan(step_kinds=kinds, train_steps=window, eta=options.noise_level,
                           shared_initial_noise=options.shared_initial_noise)
    indices = list(range(end + 1))
    indices += list(range(end + options.flash_compression, num_steps, options.flash_compression))
    if indices[-1] != num_steps:
        indices.append(num_steps)
    kinds = tuple(options.sampler if i in window else (after if i >= end else "ode")
                  for i in range(len(indices) - 1))
    return RolloutPlan(step_kinds=kinds, train_steps=window, eta=options.noise_level,
                       shared_initial_noise=options.shared_initial_noise, sigma_indices=tuple(indices))


class MixGRPO(FlowPolicyGradient):
    def __init__(self, options: MixGRPOConfig | None, config: RunConfig):
        super().__init__(options or MixGRPOConfig(), config)
        o = self.options
        high = self.num_steps - o.window_size if o.window_max_start is None else o.window_max_start
        if o.window_size > self.num_steps or not o.window_min_start <= high <= self.num_steps - o.window_size:
            raise ConfigError(
                f"MixGRPO window of {o.window_size} steps starting in {o.window_min_start}..{high} does not fit "
                f"{self.num_steps} denoising steps.",
                hint="Lower algorithm.options.window_size / window_max_start, or raise rollout.num_steps.",
            )
        if o.sampler == "cps" and high + o.window_size == self.num_steps:
            raise ConfigError("CPS adds no noise on the step to sigma 0, so a window may not reach it.",
                              hint=f"Set algorithm.options.window_max_start to at most {high - 1}.")

    def window(self, step: int) -> tuple[int, ...]:
        start = window_start(self.options, self.num_steps, step, self.config.run.seed)
        return tuple(range(start, start + self.options.window_size))

    def plan(self, step: int) -> RolloutPlan:
        start = window_start(self.options, self.num_steps, step, self.config.run.seed)
        return mixed_plan(self.options, self.num_steps, start)

    def assign_advantages(self, samples):
        metrics = super().assign_advantages(samples)
        metrics["window/start"] = float(samples[0].request.plan.train_steps[0]) if samples else 0.0
        metrics["rollout/nfe"] = float(samples[0].request.plan.num_steps) if samples else 0.0
        return metrics
