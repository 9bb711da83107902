"""``train.micro_batch_size`` is a memory setting: the loss and gradient of a minibatch are the same whether its
transitions go through the network one at a time or all in one call (``auto``), up to float reordering; and
``auto`` becomes a number only where the memory plan says the whole share would not fit."""

from __future__ import annotations

import pytest
import torch

from omnirl_core.config import RunConfig
from omnirl_core.loop.training import micro_batch, prepare_batch
from omnirl_core.testing import _requests, rollout
from omnirl_core.testing.engines import _algorithm_class, _options, toy_flow_model


def _gradients(micro: int | str) -> tuple[dict[str, torch.Tensor], dict[str, float], int]:
    """One update of the torch engine on the toy flow model (LoRA, a KL to the reference, true CFG): the gradient
    it would apply (captured at the optimizer step, which is then skipped), its metrics, and the loss calls."""
    from omnirl_plugin_torch.engine import TorchTrainEngine

    torch.manual_seed(0)
    config = RunConfig()
    config.rollout.num_steps, config.rollout.height, config.rollout.width = 4, 16, 16
    config.train.minibatches, config.train.micro_batch_size = 1, micro
    algorithm = _algorithm_class()(_options(0.05), config)
    model = toy_flow_model(seed=0)
    plan = algorithm.plan(1)
    requests = []
    for g in range(2):
        for k in range(3):
            (request,) = _requests(["a red apple", "a blue car"][g:g + 1], 16, 16, None, plan, 4.0, seed=10 * g + k)
            request.uid, request.group = 3 * g + k, g
            requests.append(request)
    samples = rollout(model, requests)
    for s in samples:
        s.reward = float(s.output.mean())
    algorithm.assign_advantages(samples)
    units = algorithm.training_units(samples)
    engine = TorchTrainEngine(model, config.train, None, "cpu")
    captured: dict[str, torch.Tensor] = {}
    calls = {"loss": 0}

    def step() -> None:
        for i, p in enumerate(model.trainable_parameters()):
            assert p.grad is not None
            captured[f"param{i}"] = p.grad.detach().clone()

    engine.optimizer.step = step  # type: ignore[method-assign]  # capture the gradient, keep the weights
    loss = algorithm.loss

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["loss"] += 1
        return loss(*args, **kwargs)

    algorithm.loss = counted  # type: ignore[method-assign]
    metrics = engine.update(algorithm, units, 1)
    return captured, metrics, calls["loss"]


def test_one_call_equals_one_row_at_a_time():
    one, m_one, calls_one = _gradients(1)
    whole, m_whole, calls_whole = _gradients("auto")
    assert calls_one == 18 and calls_whole == 1  # 6 samples x 3 trained steps: 18 calls, or one
    assert one.keys() == whole.keys() and one
    scale = max(float(g.abs().max()) for g in one.values())
    for name in one:
        # the same sum in another order: float32 rounding only, relative to the largest gradient
        torch.testing.assert_close(whole[name], one[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    for key in ("loss", "kl", "policy_loss", "grad_norm"):
        assert m_whole[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-7), key
    assert m_one["grad_norm"] > 0


def test_micro_batch_helpers():
    train = RunConfig().train
    assert train.micro_batch_size == "auto"  # the default: the memory plan decides
    assert micro_batch(train, 72) == 72 and micro_batch(train, 0) == 1
    train.minibatches = 2
    assert prepare_batch(train, 144) == 72 and prepare_batch(train, 143) == 72
    train.micro_batch_size = 4
    assert micro_batch(train, 72) == 4 and prepare_batch(train, 144) == 4


def test_auto_is_lowered_only_where_the_plan_does_not_fit(tmp_path):
    from omnirl_core import api
    from omnirl_core.planning.planner import auto_micro_batch, load_sizing, plan_memory, train_micro_batch

    config = {"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
              "train": {"micro_batch_size": "auto"}, "run": {"output_dir": str(tmp_path / "run"), "device": "cpu"}}
    resolved = api.resolve(config, probe_device=False)
    sizing = load_sizing(resolved)
    whole = train_micro_batch(resolved.config)
    cfg = resolved.config
    per_sample_steps = cfg.rollout.num_steps
    assert whole == -(-cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.train.minibatches) * per_sample_steps
    assert auto_micro_batch(resolved, sizing, 1 << 40, "cpu") == whole  # plenty of memory: the whole share
    # a budget the whole share does not fit, but half of it does: the largest power-of-two share that fits
    half = plan_memory(api.resolve([config, {"train": {"micro_batch_size": -(-whole // 2)}}], probe_device=False),
                       None, sizing).peak
    full = plan_memory(resolved, None, sizing).peak
    assert half < full
    memory = int((half + full) / 2 / 0.9)  # the plan keeps 10 % headroom
    chosen = auto_micro_batch(resolved, sizing, memory, "cpu")
    assert chosen is not None and chosen < whole
    assert plan_memory(api.resolve([config, {"train": {"micro_batch_size": chosen}}], probe_device=False),
                       memory, sizing).fits
    fixed = api.resolve([config, {"train": {"micro_batch_size": 4}}], probe_device=False)
    assert auto_micro_batch(fixed, sizing, memory, "cpu") is None  # a number the user set is kept
    # `omnirl plan` / api.plan plan what the run will do (check_run_memory's choice, for the CPU's dtype), on a copy
    from omnirl_core.planning.memory import with_device_dtype

    on_cpu = with_device_dtype(resolved, "cpu")
    run_choice = auto_micro_batch(on_cpu, sizing, memory, "cpu")
    assert run_choice is not None and run_choice < whole
    planned = api.plan(resolved, device_memory=memory)
    as_set = api.resolve([config, {"train": {"micro_batch_size": run_choice}}], probe_device=False)
    assert planned.peak == plan_memory(with_device_dtype(as_set, "cpu"), memory, sizing, device_type="cpu").peak
    assert f"train micro-batch of {run_choice} " in planned.table()
    assert resolved.config.train.micro_batch_size == "auto"  # the caller's config is left as it was
    assert f"train micro-batch of {whole} " in api.plan(resolved, device_memory=1 << 40).table()  # all fits: whole
