"""FlowGRPO's ``ema_step`` (issue 30, learning math): ``microbatch`` steps the EMA as flow_grpo's
scripts/train_sd3.py does (github.com/yifan123/flow_grpo at ac4c86e: ``ema.step(params, global_step)`` after each
of its micro-batches of ``train.batch_size`` samples, each run through every trained step, so
``gradient_accumulation_steps`` times per optimizer step, ``global_step`` counting the optimizer steps taken),
``update`` once per optimizer step. The update runs through the real torch train engine on a toy linear flow
model; the reference re-implements flow_grpo's loop over the weights the engine produced."""

from __future__ import annotations

import math

import pytest
import torch
from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig

from omnirl_core.config import RunConfig
from omnirl_core.contracts import Conditioning, GenRequest, Sample
from omnirl_core.flow.policy_gradient import transition_stats

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])  # 4 rollout steps, the first 3 trained
SAMPLES = 8
MINIBATCHES = 2  # 4 samples = 12 transitions per optimizer step
MICRO = 1  # flow_grpo's micro-batch of 1 sample: 4 accumulated micro-batches (EMA steps) per optimizer step
DECAY = 0.9


class LinearFlow:
    """v = W x (1 + s) + a per-prompt bias: one trainable 4x4 matrix."""

    device = torch.device("cpu")

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 4, generator=g) / 4)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self.weight]

    def velocity(self, x, s, cond, guidance_scale=1.0, uncond=None):
        v = torch.einsum("oc,bchw->bohw", self.weight, x) * (1 + s.view(-1, 1, 1, 1))
        return v + cond.tensors["bias"][..., None, None]


def _config(interval: int, ema_step: str | None) -> tuple[FlowGRPOConfig, RunConfig]:
    extra = {} if ema_step is None else {"ema_step": ema_step}
    options = FlowGRPOConfig(ema=True, ema_decay=DECAY, ema_interval=interval, clip_range=0.5, beta=0.0, **extra)
    run = RunConfig.model_validate({"rollout": {"num_steps": len(SIGMAS) - 1},
                                    "train": {"minibatches": MINIBATCHES, "micro_batch_size": MICRO, "lr": 0.05}})
    return options, run


def _samples(algo: FlowGRPO, model: LinearFlow, step: int) -> list[Sample]:
    """A step's rollout: random latents, rollout log-probs = the trainer's under the current weights."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for i in range(SAMPLES):
        request = GenRequest(uid=i, prompt=f"p{i // 4}", prompt_index=i // 4, group=i // 4, seed=i, height=8, width=8,
                             plan=algo.plan(step))
        out.append(Sample(request, torch.randn(len(SIGMAS), 4, 3, 3, generator=g), SIGMAS.clone(),
                          torch.zeros(len(SIGMAS) - 1), None, advantage=float(torch.randn(1, generator=g)),
                          cond=Conditioning({"bias": torch.randn(1, 4, generator=g)})))
    units = algo.training_units(out)
    with torch.no_grad():
        _, _, logp, _ = transition_stats(model, units, algo.plan(step).eta)
    for unit, lp in zip(units, logp):
        unit.sample.logprobs[unit.step] = lp
    return out


def _train(options: FlowGRPOConfig, run: RunConfig, steps: int, resume_at: int | None = None):
    """``steps`` training steps through the torch engine; returns the algorithm and the weights after
    every optimizer step (index 0: the initial ones). ``resume_at``: after that step the algorithm is rebuilt
    from its checkpointed state (``state`` / ``state_tensors``), as a resumed run does."""
    from omnirl_core.plugins import get_plugin_manager

    engine_class = get_plugin_manager().resolve("engine", "torch").load_factory()  # the installed engine, by name

    model = LinearFlow()
    engine = engine_class(model, run.train, None, "cpu")
    algo = FlowGRPO(options, run)
    weights = [model.weight.detach().clone()]
    for step in range(1, steps + 1):
        if step - 1 == resume_at:
            fresh = FlowGRPO(options, run)
            fresh.load_state(algo.state())
            fresh.load_state_tensors(algo.state_tensors(), model)
            algo = fresh
        fold = algo.after_optimizer_step

        def record(m, fold=fold):
            weights.append(m.weight.detach().clone())
            fold(m)

        algo.after_optimizer_step = record
        units = algo.training_units(_samples(algo, model, step))
        engine.update(algo, units, step)
        del algo.after_optimizer_step
    return algo, weights


def flow_grpo_ema_loop(weights: list[torch.Tensor], accumulation: int, interval: int) -> torch.Tensor:
    """flow_grpo's loop: each micro-batch ends with ``ema.step(params, global_step)``; the last micro-batch of an
    accumulation cycle first takes the optimizer step (``global_step += 1``, new weights). ``EMAModuleWrapper``:
    when (step + 1) % interval == 0, ema += (1 - min((1 + step) / (10 + step), decay)) (theta - ema)."""
    ema = weights[0].clone()
    global_step = 0
    for _ in range(len(weights) - 1):  # one accumulation cycle per optimizer step
        for micro in range(accumulation):
            if micro == accumulation - 1:
                global_step += 1
            theta = weights[global_step]
            if (global_step + 1) % interval == 0:
                ema += (1 - min((1 + global_step) / (10 + global_step), DECAY)) * (theta - ema)
    return ema


def _accumulation() -> int:
    """flow_grpo's micro-batches per optimizer step with its batch = micro_batch_size samples."""
    return math.ceil(SAMPLES // MINIBATCHES / MICRO)


@pytest.mark.parametrize("interval", [1, 2])
def test_microbatch_steps_the_ema_as_flow_grpo_does(interval: int):
    algo, weights = _train(*_config(interval, "microbatch"), steps=3)
    assert algo.optimizer_steps == 3 * MINIBATCHES and len(weights) == 3 * MINIBATCHES + 1
    assert float((weights[-1] - weights[0]).abs().max()) > 0.05  # the weights moved
    expected = flow_grpo_ema_loop(weights, _accumulation(), interval)
    torch.testing.assert_close(algo.ema_weights.shadow[0], expected, rtol=1e-5, atol=1e-6)
    # update mode is flow_grpo's rule with one EMA step per optimizer step: another EMA, further from the weights
    once, same_weights = _train(*_config(interval, "update"), steps=3)
    for a, b in zip(weights, same_weights):
        assert torch.equal(a, b)  # the EMA never feeds back into training
    torch.testing.assert_close(once.ema_weights.shadow[0], flow_grpo_ema_loop(weights, 1, interval),
                               rtol=1e-5, atol=1e-6)
    gap = float((once.ema_weights.shadow[0] - expected).abs().max())
    assert gap > 1e-3, gap
    assert algo.ema_weights.distance() < once.ema_weights.distance()


def test_update_is_the_default():
    assert FlowGRPOConfig().ema_step == "update"
    assert _config(2, None)[0].ema_step == "update"


@pytest.mark.parametrize("ema_step", ["update", "microbatch"])
def test_a_resumed_run_keeps_the_same_ema(ema_step: str):
    """The EMA and its clock are the whole state: the micro-batch count is 0 between steps, so an algorithm
    rebuilt from ``state`` / ``state_tensors`` after step 2 continues exactly."""
    options, run = _config(1, ema_step)
    straight, weights = _train(options, run, steps=4)
    resumed, resumed_weights = _train(options, run, steps=4, resume_at=2)
    assert straight.state() == resumed.state() == {"optimizer_steps": 4 * MINIBATCHES}
    for a, b in zip(weights, resumed_weights):
        assert torch.equal(a, b)
    assert torch.equal(straight.ema_weights.shadow[0], resumed.ema_weights.shadow[0])
