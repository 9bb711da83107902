"""Weight sync actor -> rollout between two workers with their own models (as in the split placement):
LoRA-only or full state; after a sync, rollout and trainer log-probs agree again; a stale rollout shows
up in the IS diagnostics and the RS mask rejects it; in bypass mode the mask of a sample uses all of its
steps, and persistent rejections switch the run to recompute."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omnirl_core.flow.policy_gradient import transition_stats
from omnirl_core.loop.controller import Controller
from omnirl_core.loop.worker import Worker
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run
from omnirl_core.weights import state_bytes

PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
           "omnirl_plugin_torch", "omnirl_plugin_color"]


def _workers(tmp_path: Path, lora: bool, lr: float = 3e-2, **train):
    manager = PluginManager()
    manager.load_modules(PLUGINS)
    resolved = resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny", "lora": {"enabled": lora, "rank": 4, "alpha": 4}},
        "algorithm": {"name": "flowgrpo", "options": {"beta": 0.0}},
        "rewards": [{"name": "color"}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "num_steps": 3, "height": 32, "width": 32},
        "train": {"lr": lr, "minibatches": 1, "micro_batch_size": 8, **train},
        "run": {"seed": 5, "output_dir": str(tmp_path), "device": "cpu"},
    }])
    controller = Controller(resolved, tmp_path)
    actor = Worker(resolved, {"actor"})
    rollout = Worker(resolved, {"rollout"})
    actor.setup()
    rollout.setup()
    rollout.load_trained_state(actor.trained_state())
    return controller, actor, rollout


def _rollout(controller, rollout, step: int):
    samples = sorted(rollout.generate(controller.requests(step)), key=lambda s: s.request.uid)
    for s in samples:
        s.reward = float(s.output[0].mean())
    controller.algorithm.assign_advantages(samples)
    return samples, controller.algorithm.training_units(samples)


def _max_delta(actor, units) -> float:
    with torch.no_grad():
        _, _, logp, _ = transition_stats(actor.model, units, units[0].sample.request.plan.eta)
    rollout = torch.stack([u.rollout_logprob for u in units])
    return float((logp - rollout).abs().max())


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_after_sync_rollout_and_trainer_logprobs_agree(tmp_path: Path, lora: bool):
    controller, actor, rollout = _workers(tmp_path, lora)
    state = actor.trained_state()
    full_keys = set(actor.model.denoiser.state_dict())
    if lora:  # only the adapter moves, a small part of the denoiser
        assert state and all("lora_" in k for k in state)
        assert state_bytes(state) < 0.5 * sum(t.numel() * t.element_size()
                                              for t in actor.model.denoiser.state_dict().values())
    else:
        assert set(state) == full_keys
    _, units = _rollout(controller, rollout, 1)
    assert _max_delta(actor, units) < 1e-5  # synced at setup
    actor.update(units, 1)
    _, stale = _rollout(controller, rollout, 2)
    assert _max_delta(actor, stale) > 1e-4  # the trainer moved on, the rollout did not
    rollout.load_trained_state(actor.trained_state())
    _, fresh = _rollout(controller, rollout, 2)
    assert _max_delta(actor, fresh) < 1e-5


def test_stale_rollout_is_seen_by_is_diagnostics_and_rejected_by_the_rs_mask(tmp_path: Path):
    controller, actor, rollout = _workers(tmp_path, True, lr=0.1, rs_band=(0.9999, 1.0001))
    _, units = _rollout(controller, rollout, 1)
    first = actor.update(units, 1)
    assert first["rs/rejected_frac"] == 0.0 and first["logprob/abs_delta_max"] < 1e-5
    _, stale = _rollout(controller, rollout, 2)  # no sync: rollout log-probs come from old weights
    metrics = actor.update(stale, 2)
    assert metrics["logprob/abs_delta_max"] > 1e-4
    assert metrics["is/kl_k3"] > 0
    assert 0.0 < metrics["rs/rejected_frac"] <= 1.0
    assert metrics["is/ess"] <= 1.0


# -- bypass mode on a real model: the mask of a sample is decided once all its steps are seen ----------

def _mismatched_units(tmp_path, old_logprob: str, band=None):
    """Tiny Qwen-Image: the rollout worker's LoRA weights differ from the trainer's by a little noise (a
    bad weight sync), so every step has its own delta; returns the pieces for two identical trainers."""
    from omnirl_core.loop.worker import Worker

    controller, actor, rollout = _workers(tmp_path, True, lr=1e-2, old_logprob=old_logprob, micro_batch_size=1)
    state = actor.trained_state()
    gen = torch.Generator().manual_seed(0)
    rollout.load_trained_state({k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in state.items()})
    twin = Worker(controller.resolved, {"actor"})
    twin.setup()
    return controller, actor, twin, rollout, _rollout


def _trained(worker) -> dict:
    return {k: v.detach().clone() for k, v in worker.trained_state().items()}


def test_bypass_mask_uses_every_step_of_a_sample_even_across_micro_batches(tmp_path):
    controller, actor, twin, rollout, roll = _mismatched_units(tmp_path, "bypass")
    cfg = controller.cfg.train
    _, units = roll(controller, rollout, 1)
    # per sample: the mean delta over all its steps vs over its first step only (what the first
    # micro-batch of size 1 sees); pick a band edge between them for some sample, so its mask flips
    from omnirl_core.flow.policy_gradient import transition_stats

    with torch.no_grad():
        _, _, logp, _ = transition_stats(actor.model, units, units[0].sample.request.plan.eta)
    delta = (logp - torch.stack([u.rollout_logprob for u in units])).tolist()
    per_sample: dict[int, list[float]] = {}
    for u, d in zip(units, delta):
        per_sample.setdefault(id(u.sample), []).append(d)
    pairs = [(ds[0], sum(ds) / len(ds)) for ds in per_sample.values()]
    first, full = max(pairs, key=lambda p: abs(p[0] - p[1]))
    assert abs(first - full) > 1e-4, "the steps of a sample should disagree"
    edge = (first + full) / 2
    cfg.rs_band = (math.exp(edge), 100.0) if full > first else (1e-3, math.exp(edge))

    # one micro-batch per unit: masks are decided progressively and fixed after the minibatch
    cfg.micro_batch_size = 1
    progressive = actor.update(units, 1)
    assert progressive["rs/corrected_units"] > 0
    # one micro-batch holding everything: every mask is final from the start
    _, units_again = roll(controller, rollout, 1)
    cfg.micro_batch_size = len(units_again)
    at_once = twin.update(units_again, 1)
    assert at_once["rs/corrected_units"] == 0
    assert progressive["rs/rejected_frac"] == pytest.approx(at_once["rs/rejected_frac"])
    assert 0 < at_once["rs/rejected_frac"] < 1
    a, b = _trained(actor), _trained(twin)
    # AdamW's first step moves a weight by up to lr, so a wrong mask shows as differences of order lr; float
    # rounding of micro-batch 1 vs one micro-batch of all units, which AdamW's normalisation scales up where a
    # gradient is tiny, stays near 1e-5 (1.4e-5 seen): the bound sits between the two, at lr / 100
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-2 * cfg.lr


def test_bypass_falls_back_to_recompute_when_rejections_persist_and_resume_keeps_it(tmp_path):
    """Inline run, bypass mode; after each rollout the trainer's LoRA weights are nudged (what a stale or
    mismatched rollout engine does to the log-probs), so the RS mask rejects samples at every step."""

    def controller(steps: int) -> Controller:
        manager = PluginManager()
        manager.load_modules(PLUGINS)
        resolved = resolve_run(manager, [{
            "model": {"name": "qwen-image", "preset": "tiny", "lora": {"rank": 4, "alpha": 4}},
            "algorithm": {"name": "flowgrpo"}, "rewards": [{"name": "color"}],
            "rollout": {"prompts_per_step": 2, "group_size": 2, "num_steps": 3, "height": 32, "width": 32},
            "train": {"old_logprob": "bypass", "rs_band": [0.9999, 1.0001], "rs_fallback": 0.05,
                      "rs_fallback_steps": 2},
            "run": {"seed": 3, "steps": steps, "save_every": 3, "output_dir": str(tmp_path), "device": "cpu"},
        }])
        ctl = Controller(resolved, tmp_path)
        ctl.run_dir.prepare(resolved.dump(), [])
        rollout = ctl.executor.rollout
        gen = torch.Generator().manual_seed(1)

        def mismatched(requests):
            out = rollout(requests)
            with torch.no_grad():
                for p in ctl.executor.model.trainable_parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
            return out

        ctl.executor.rollout = mismatched
        return ctl

    first = controller(3)
    first.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["rs/rejected_frac"] > 0.05 for r in records[:2]] == [True, True]
    assert [r["correction/recompute"] for r in records] == [0.0, 0.0, 1.0]
    assert records[1].get("correction/fallback") == 1.0 and "correction/fallback" not in records[0]
    # the switch is run-time state: the controller's and the actor's, never the config object's
    assert first.old_logprob == "recompute" and first.executor.worker.algorithm.old_logprob == "recompute"
    assert first.cfg.train.old_logprob == "bypass"
    # the saved config still says bypass; the checkpoint carries the switch
    resumed = controller(4)
    assert resumed.cfg.train.old_logprob == "bypass" and resumed.old_logprob == "bypass"
    resumed.run()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and last["correction/recompute"] == 1.0


def test_a_worker_that_does_not_roll_out_tells_its_train_engine(tmp_path: Path, monkeypatch):
    """``TrainEngine.rollout_elsewhere``: called once on a train worker of the split placement (an engine that scores
    with its own copy of the weights, megatron's, then moves the model's module to host memory), never on a worker
    that rolls out too."""
    from omnirl_core.contracts.engines import TrainEngine

    calls: list[str] = []
    monkeypatch.setattr(TrainEngine, "rollout_elsewhere", lambda self: calls.append(type(self).__name__))
    _controller, actor, rollout = _workers(tmp_path / "split", lora=True)
    assert len(calls) == 1 and actor.trainer is not None and rollout.trainer is None
    manager = PluginManager()
    manager.load_modules(PLUGINS)
    colocated = Worker(resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
        "rewards": [{"name": "color"}], "run": {"device": "cpu", "output_dir": str(tmp_path / "colocated")}}]),
        {"actor", "rollout"})
    colocated.setup()
    assert colocated.trainer is not None and len(calls) == 1
