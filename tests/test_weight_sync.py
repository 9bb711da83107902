"""Weight sync actor -> rollout between two workers with their own models (as in the split placement):
LoRA-only or full state; after a sync, rollout and trainer log-probs agree again; a stale rollout shows
up in the IS diagnostics and the RS mask rejects it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnirl_core.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.policy_gradient import transition_stats
from omnirl_core.resolve import resolve_run
from omnirl_core.weight_sync import state_bytes, sync_mode
from omnirl_core.worker import Worker

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
    actor = Worker(resolved, {"actor"}, algorithm=controller.algorithm)
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
    assert sync_mode(colocated=False, lora=lora) == ("lora" if lora else "full")
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
