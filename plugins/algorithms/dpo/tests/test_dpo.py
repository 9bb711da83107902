"""Diffusion-DPO: the loss against an independent computation (log 2 at zero margin), pairs that share noise
and level, the reference (base model or refreshed snapshot) on the tiny Qwen-Image model, the preference
file, and online and offline runs through the CLI."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omnirl_plugin_dpo.algorithm import DiffusionDPO, DPOConfig, dpo_loss, load_preferences
from PIL import Image

from omnirl_core.config import ModelSection, RunConfig
from omnirl_core.contracts import GenRequest
from omnirl_core.errors import ConfigError
from omnirl_core.loop.training import MetricMean, prepare_all
from omnirl_core.testing.forkserver import run_omnirl

PROMPTS = ["a red square", "a blue square"]


def _config(**rollout) -> RunConfig:
    return RunConfig.model_validate({"rollout": {"num_steps": 4, "height": 32, "width": 32, "group_size": 4,
                                                 **rollout}})


@pytest.fixture(scope="module")
def model():
    from omnirl_core.config import LoraConfig
    from omnirl_core.plugins import PluginManager

    manager = PluginManager()
    manager.load_entry_points()
    m = manager.resolve("model", "qwen-image").load_factory()(ModelSection(name="qwen-image", preset="tiny"), None,
                                                              "cpu")
    m.setup_training(LoraConfig(rank=4, alpha=4), need_reference=True)
    return m


def _samples(model, rewards: list[list[float]]) -> list[SimpleNamespace]:
    """Rollout-like samples (random final latents) with the given rewards per group."""
    out, uid = [], 0
    g = torch.Generator().manual_seed(0)
    shape = model.latent_shape(32, 32)
    for group, values in enumerate(rewards):
        cond = model.encode([PROMPTS[group % 2]])
        for r in values:
            request = GenRequest(uid=uid, prompt=PROMPTS[group % 2], prompt_index=group, group=group, seed=100 + uid,
                                 height=32, width=32, plan=None)
            out.append(SimpleNamespace(request=request, prompt=request.prompt, reward=r,
                                       latents=torch.randn(5, *shape, generator=g), cond=cond))
            uid += 1
    return out


# -- the loss -------------------------------------------------------------------------------------------

def test_dpo_loss_is_log2_at_zero_margin_and_matches_softplus():
    zero = torch.zeros(3)
    loss, delta = dpo_loss(zero + 0.4, zero + 0.7, zero + 0.4, zero + 0.7, beta=2000.0)
    torch.testing.assert_close(loss, torch.full((3,), math.log(2.0)))
    assert torch.equal(delta, zero)
    g = torch.Generator().manual_seed(0)
    ew, el, rw, rl = (torch.rand(5, generator=g) for _ in range(4))
    loss, delta = dpo_loss(ew, el, rw, rl, beta=100.0)
    expected = [math.log1p(math.exp(50.0 * ((a - c) - (b - d)))) for a, b, c, d in
                zip(ew.tolist(), el.tolist(), rw.tolist(), rl.tolist())]
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    # fitting the winner better than the reference does (and the loser not) lowers the loss below log 2
    better, _ = dpo_loss(torch.tensor([0.3]), torch.tensor([0.7]), torch.tensor([0.4]), torch.tensor([0.7]), 100.0)
    assert float(better) < math.log(2.0)


# -- pairs ----------------------------------------------------------------------------------------------

def test_pairs_are_best_vs_worst_of_a_group_with_shared_noise_and_level(model):
    algo = DiffusionDPO(DPOConfig(pairs_per_group=2, noise_draws=3), _config())
    samples = _samples(model, [[0.2, 0.9, 0.5, 0.1], [0.6, 0.3, 0.8, 0.4]])
    algo.plan(1)
    units = algo.training_units(samples)
    assert len(units) == 2 * 2 * 3  # groups x pairs x draws
    pairs = []
    for u in units:
        win = next(s for s in samples if torch.equal(s.latents[-1], u.chosen))
        lose = next(s for s in samples if torch.equal(s.latents[-1], u.rejected))
        pairs.append((win.reward, lose.reward))
        assert u.eps.shape == u.chosen.shape and 0.0 <= float(u.sigma) <= 1.0
        assert u.prompt == win.prompt == lose.prompt
    assert sorted(set(pairs)) == [(0.5, 0.2), (0.6, 0.4), (0.8, 0.3), (0.9, 0.1)]
    # the draws of one pair differ; winner and loser are noised with one (eps, s): one field each per unit
    first_pair = [u for u in units if torch.equal(u.chosen, units[0].chosen) and torch.equal(u.rejected,
                                                                                              units[0].rejected)]
    assert len(first_pair) == 3 and len({float(u.sigma) for u in first_pair}) == 3


def test_loss_on_the_model_is_log2_before_any_update_and_drops_after_one(model):
    saved = [p.detach().clone() for p in model.trainable_parameters()]
    algo = DiffusionDPO(DPOConfig(beta=100.0, pairs_per_group=2), _config())
    algo.plan(1)
    units = algo.training_units(_samples(model, [[0.2, 0.9, 0.5, 0.1], [0.6, 0.3, 0.8, 0.4]]))
    with torch.no_grad():
        prepare_all(algo, model, units, len(units), MetricMean())  # the runtime's no-grad pass
    loss, metrics = algo.loss(model, units)
    assert float(loss.detach()) == pytest.approx(math.log(2.0), abs=1e-6)  # LoRA starts at 0: policy = reference
    assert metrics["dpo/accuracy"] == 0.0 and metrics["dpo/implicit_margin"] == 0.0
    opt = torch.optim.SGD(model.trainable_parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        loss, _ = algo.loss(model, units)
        loss.backward()
        opt.step()
    after, metrics = algo.loss(model, units)
    assert float(after.detach()) < math.log(2.0) and metrics["dpo/accuracy"] > 0.5
    with torch.no_grad():  # leave the shared model as it was
        for p, s in zip(model.trainable_parameters(), saved):
            p.copy_(s)


def test_refreshed_reference_snapshot_catches_up_with_the_policy():
    net = torch.nn.Linear(3, 3)
    fake = SimpleNamespace(trainable_parameters=lambda: list(net.parameters()))
    algo = DiffusionDPO(DPOConfig(ref_update_every=2), _config())
    assert not algo.uses_reference
    algo._refresh_snapshot(fake, step=1)
    start = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    algo._refresh_snapshot(fake, step=2)  # 1 step after the snapshot: kept
    assert all(torch.equal(s, p) for s, p in zip(algo.snapshot.shadow, start))
    algo._refresh_snapshot(fake, step=3)  # 2 steps: refreshed to the policy
    assert all(torch.equal(s, p) for s, p in zip(algo.snapshot.shadow, net.parameters()))


# -- offline preference data ----------------------------------------------------------------------------

def _preference_file(tmp_path: Path, records: int = 4) -> Path:
    lines = []
    for i in range(records):
        for name, colour in (("c", (220, 30, 30)), ("r", (30, 30, 220))):
            Image.new("RGB", (40, 40), colour).save(tmp_path / f"{name}{i}.png")
        lines.append(json.dumps({"prompt": "a red square", "chosen": f"c{i}.png", "rejected": f"r{i}.png"}))
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_preference_file_errors_name_the_problem(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_preferences(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "chosen": "a.png"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: expected a JSON object"):
        load_preferences(str(bad))
    bad.write_text('{"prompt": "x", "chosen": "a.png", "rejected": "b.png"}\n')
    with pytest.raises(ConfigError, match="chosen image 'a.png' not found"):
        load_preferences(str(bad))
    with pytest.raises(ConfigError, match="needs a preference file"):
        DiffusionDPO(DPOConfig(mode="offline"), _config())
    records = load_preferences(str(_preference_file(tmp_path, 2)))
    assert len(records) == 2 and Path(records[0]["chosen"]).is_absolute()


def test_encode_images_gives_deterministic_latents_of_the_model_shape(model):
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    z = model.encode_images(images)
    assert z.shape == (2, *model.latent_shape(32, 32)) and z.dtype == torch.float32
    assert torch.equal(z, model.encode_images(images))
    assert not torch.allclose(z[0], z[1])


def test_offline_pairs_are_encoded_in_prepare(model, tmp_path: Path):
    algo = DiffusionDPO(DPOConfig(mode="offline", preference_file=str(_preference_file(tmp_path)),
                                  pairs_per_step=3), _config())
    algo.plan(5)
    units = algo.training_units([])
    assert len(units) == 3 and units[0].chosen is None
    with torch.no_grad():
        prepare_all(algo, model, units, len(units), MetricMean())  # the runtime's no-grad pass
    assert units[0].chosen.shape == tuple(model.latent_shape(32, 32)) == units[0].eps.shape
    assert units[0].ref_error.shape == (2,)
    loss, _ = algo.loss(model, units)
    assert float(loss.detach()) == pytest.approx(math.log(2.0), abs=1e-6)
    algo.plan(5)
    assert [u.chosen_path for u in algo.training_units([])] == [u.chosen_path for u in units]  # per-step seed


# -- end to end -----------------------------------------------------------------------------------------

def _cli(tmp_path: Path, *extra: str) -> list[dict]:
    run = tmp_path / "run"
    proc = run_omnirl(["train", "--model", "qwen-image", "--algo", "dpo", "--preset", "tiny", "--output-dir", str(run),
                       "--steps", "2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", *extra],
                       timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cli_online_run(tmp_path: Path):
    records = _cli(tmp_path)
    assert records[0]["dpo/reward_gap"] > 0  # winners beat losers
    assert records[0]["loss"] == pytest.approx(math.log(2.0), abs=0.05)  # first minibatch: policy = reference


@pytest.mark.slow
def test_cli_offline_run(tmp_path: Path):
    prefs = _preference_file(tmp_path)
    records = _cli(tmp_path, "--set", "algorithm.options.mode=offline",
                   "--set", f"algorithm.options.preference_file={prefs}", "--set", "algorithm.options.pairs_per_step=4")
    assert len(records) == 2 and "dpo/reward_gap" not in records[0]
    assert math.isfinite(records[-1]["loss"]) and "reward/mean" in records[-1]


def test_a_separate_reference_worker_gives_the_actors_reference_errors(tmp_path: Path):
    """Online DPO with the base model as reference: a reference worker (here in-process) computes the
    errors the actor would compute with its adapters disabled; the runs are the same."""
    from omnirl_core.testing import run_train

    args = ["--model", "qwen-image", "--algo", "dpo", "--preset", "tiny", "--steps", "2",
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4", "--set", "rollout.num_steps=4"]
    own = run_train(tmp_path / "own", *args)
    separate = run_train(tmp_path / "separate", *args, "--set", "run.reference=separate")
    keys = [k for k in own[-1] if k.startswith(("reward/", "loss", "dpo/"))]
    assert any(k.startswith("dpo/") for k in keys)
    for a, b in zip(own, separate):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
