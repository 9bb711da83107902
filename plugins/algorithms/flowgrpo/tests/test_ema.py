"""FlowGRPO's EMA of the trained weights (``ema: true``): the schedule of flow_grpo's EMA wrapper (re-implemented
below from flow_grpo/ema.py, github.com/yifan123/flow_grpo, called once per optimizer step as its train_sd3.py does
without gradient accumulation), the swap for evaluation, the KL reduction option, and a tiny run: evaluation
during training (with ``run.eval_steps``) and ``omnirl eval`` see the EMA (checkpoints' ``eval-weights/``),
``--trained-weights`` the trained weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from omnirl_plugin_flowgrpo.algorithm import FlowGRPO, FlowGRPOConfig, kl_term
from safetensors.torch import load_file

from omnirl_core.algorithm import ALGORITHM_TENSORS, EVAL_WEIGHTS
from omnirl_core.config import RunConfig
from omnirl_core.testing.forkserver import run_omnirl


class Params:
    """What FlowGRPO's EMA reads of a model: its trainable parameters."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5))]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.params


def flow_grpo_ema(ema: list[torch.Tensor], params: list[torch.Tensor], step: int, decay: float, interval: int):
    """flow_grpo's ``EMAModuleWrapper.step(parameters, optimization_step)``."""
    one_minus_decay = 1 - min((1 + step) / (10 + step), decay)
    if (step + 1) % interval == 0:
        for e, p in zip(ema, params):
            e.add_(one_minus_decay * (p - e))


def config() -> RunConfig:
    return RunConfig.model_validate({"model": {"name": "qwen-image"}, "algorithm": {"name": "flowgrpo"},
                                     "rollout": {"num_steps": 4}})


def test_ema_follows_flow_grpo_schedule_and_swaps_in_for_evaluation():
    model = Params(0)
    algo = FlowGRPO(FlowGRPOConfig(ema=True, ema_decay=0.9, ema_interval=3), config())
    assert algo.has_eval_policy
    ref = [p.detach().clone() for p in model.params]  # flow_grpo starts its EMA from the initial weights
    with algo.eval_policy(model):
        pass  # first use: the EMA starts at the current weights
    g = torch.Generator().manual_seed(1)
    for k in range(1, 41):  # an optimizer step, then the hook
        with torch.no_grad():
            for p in model.params:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        algo.after_optimizer_step(model)
        flow_grpo_ema(ref, [p.detach() for p in model.params], k, 0.9, 3)
    assert algo.optimizer_steps == 40
    for e, r in zip(algo.ema_weights.shadow, ref):
        torch.testing.assert_close(e, r, rtol=1e-5, atol=1e-6)
    trained = [p.detach().clone() for p in model.params]
    assert max(float((t - r).abs().max()) for t, r in zip(trained, ref)) > 0.05  # the EMA lags
    with algo.eval_policy(model):
        for p, r in zip(model.params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    for p, t in zip(model.params, trained):
        assert torch.equal(p.detach(), t)  # the trained weights are back
    # the checkpointed state restores the same EMA and clock
    other = FlowGRPO(FlowGRPOConfig(ema=True, ema_decay=0.9, ema_interval=3), config())
    other.load_state(algo.state())
    other.load_state_tensors(algo.state_tensors(), Params(5))
    assert other.optimizer_steps == 40
    for a, b in zip(other.ema_weights.shadow, algo.ema_weights.shadow):
        assert torch.equal(a, b)


def test_without_ema_nothing_is_kept():
    algo = FlowGRPO(FlowGRPOConfig(), config())
    model = Params(0)
    before = [p.detach().clone() for p in model.params]
    algo.after_optimizer_step(model)
    with algo.eval_policy(model):
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.params, before))
    assert not algo.has_eval_policy and algo.state() == {} and algo.state_tensors() == {}


def test_kl_reduction_sum_is_the_whole_transition_kl():
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    std = torch.tensor([0.3, 0.5, 0.7])
    s, s_next = torch.tensor([0.9, 0.9, 0.9]), torch.tensor([0.6, 0.6, 0.6])
    summed = kl_term("exact", "sde", mean, ref, std, s, s_next, "sum")
    # KL(N(mu, std^2 I) || N(mu_ref, std^2 I)) = |mu - mu_ref|^2 / (2 std^2), summed over the 16 elements
    expected = ((mean - ref) ** 2).sum(dim=(1, 2, 3)) / (2 * std**2)
    torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl_term("exact", "sde", mean, ref, std, s, s_next), expected / 16, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        kl_term("exact", "sde", mean, ref, std, s, s_next, "max")


def omnirl(*args: str) -> subprocess.CompletedProcess:
    return run_omnirl([*args], timeout=600)


@pytest.mark.slow
def test_run_evaluates_and_saves_the_ema(tmp_path: Path):
    run = tmp_path / "run"
    proc = omnirl("train", "--model", "qwen-image", "--algo", "flowgrpo", "--preset", "tiny", "--steps", "2",
                  "-o", str(run), "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                  "--set", "train.minibatches=2", "--set", "algorithm.options.ema=true",
                  "--set", "algorithm.options.ema_interval=2", "--set", "run.save_every=2",
                  "--set", "data.prompts=builtin:colors", "--set", "run.eval_every=2", "--set", "run.eval_prompts=2",
                  "--set", "run.eval_samples=2", "--set", "rollout.num_steps=4", "--set", "run.eval_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["flowgrpo/ema_lag_rms"] == 0.0 and rows[1]["flowgrpo/ema_lag_rms"] > 0
    in_run = json.loads((run / "eval" / "step-000002" / "results.json").read_text())
    assert in_run["num_steps"] == 6  # run.eval_steps, not the rollout's 4
    ckpt = run / "checkpoints" / "step-000002"
    assert json.loads((ckpt / "algorithm.json").read_text()) == {"optimizer_steps": 4}
    ema = load_file(str(ckpt / EVAL_WEIGHTS / "pytorch_lora_weights.safetensors"))
    trained = load_file(str(ckpt / "pytorch_lora_weights.safetensors"))
    shadow = load_file(str(ckpt / ALGORITHM_TENSORS))
    assert set(ema) == set(trained) and len(shadow) == len(ema)
    assert max(float((ema[k] - trained[k]).abs().max()) for k in ema) > 0  # the EMA lags the trained weights
    assert sorted(float(v.abs().sum()) for v in ema.values()) == pytest.approx(
        sorted(float(v.abs().sum()) for v in shadow.values()), rel=1e-6)
    # omnirl eval loads the EMA by default: the number the run logged for its evaluation at step 2
    eval_args = ["eval", str(run), "--max-prompts", "2", "--samples", "2", "--format", "json"]
    proc = omnirl(*eval_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "evaluation weights" in proc.stderr
    result = json.loads(proc.stdout)
    assert result["weights"].endswith(EVAL_WEIGHTS) and result["num_steps"] == 6
    ema_mean = result["models"]["trained"]["summary"]["reward"]["mean"]
    assert ema_mean == pytest.approx(rows[1]["eval/reward/mean"], abs=1e-6)
    proc = omnirl(*eval_args, "--trained-weights")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["weights"] == str(ckpt)
    assert result["models"]["trained"]["summary"]["reward"]["mean"] != ema_mean
