"""The vllm-omni engine on the tiny Qwen-Image preset (random weights, CPU, fp32, vllm-omni on omnirl's CPU
platform), against the diffusers engine and the trainer.

Marked ``engines``: they need the engine's environment (``omnirl env build vllm-omni``) and skip without it.
The tests share one vllm-omni start (the engine keeps one server per process; starting takes a minute or
more here) but the last, a real ``omnirl train`` process with its own; run by ``.ci/engines``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
from omnirl_core.flow.policy_gradient import Transition, transition_stats
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing import check_weight_update_reaches_engine, require_engine_environment

pytestmark = pytest.mark.engines

PROMPTS = ["a red square", "a blue square on a long green field under a grey sky", "cat"]
ETA = 0.7


@pytest.fixture(scope="module", autouse=True)
def engine_environment():
    require_engine_environment("vllm-omni")


@pytest.fixture(scope="module")
def model():
    create_model = get_plugin_manager().resolve("model", "qwen-image").load_factory()
    m = create_model(ModelSection(name="qwen-image", preset="tiny"), None, "cpu")
    m.setup_training(LoraConfig(rank=4, alpha=4), need_reference=False)
    return m


def engine(model, **options):
    from omnirl_plugin_vllm_omni.engine import VllmOmniRolloutEngine, VllmOmniRolloutOptions

    return VllmOmniRolloutEngine(model, VllmOmniRolloutOptions(**options), torch.device("cpu"))


def requests_for(plans: list[RolloutPlan], guidance: float = 1.0, shared_noise: bool = False) -> list[GenRequest]:
    out = []
    for uid, plan in enumerate(plans):
        out.append(GenRequest(uid=uid, prompt=PROMPTS[uid % len(PROMPTS)], prompt_index=uid % 3, group=uid % 3,
                              seed=1000 + 7 * uid, height=32, width=32, plan=plan, guidance_scale=guidance,
                              noise_seed=99 if shared_noise else None))
    return out


PLANS = [
    RolloutPlan(step_kinds=("sde", "sde", "ode"), train_steps=(0, 1), eta=ETA),
    RolloutPlan(step_kinds=("cps", "cps", "ode"), train_steps=(0, 1), eta=ETA),
    RolloutPlan(step_kinds=("ode", "dance", "ode"), train_steps=(1,), eta=ETA),
    # MixGRPO-Flash style: an SDE window, then second-order steps on a subset of a finer schedule
    RolloutPlan(step_kinds=("sde", "dpm2", "dpm2"), train_steps=(0,), eta=ETA, sigma_indices=(0, 1, 3, 5)),
]


def by_uid(samples) -> dict[int, Sample]:
    return {s.request.uid: s for s in samples}


def diffusers_samples(model, requests) -> dict[int, Sample]:
    diffusers_engine = get_plugin_manager().resolve("engine", "diffusers").load_factory()
    return by_uid(diffusers_engine(model, None, "cpu").generate(requests))


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), "NaN (deterministic-step) log-probs differ in place"
    return float((a[~nan_a] - b[~nan_b]).abs().max()) if (~nan_a).any() else 0.0


def trainer_logprob_delta(model, samples: list[Sample]) -> float:
    """Largest |trainer's recomputed log-prob - rollout's| over the trained steps (logprob/abs_delta_max)."""
    worst = 0.0
    with torch.no_grad():
        for sample in samples:
            for step in sample.request.plan.train_steps:
                unit = Transition(sample, step)
                _, _, logp, _ = transition_stats(model, [unit], sample.request.plan.eta)
                worst = max(worst, abs(float(logp[0]) - float(sample.logprobs[step])))
    return worst


def test_the_rollout_engine_contract(model):
    """The core's rollout-engine suite (``check_rollout_engine``) on the tiny Qwen-Image preset (the engine loads
    the model's pipeline directory, so not on the core's toy model): one sample per request with its request,
    two plans, two latent shapes, guided and unguided requests, the trajectory and conditioning, each request the
    same in other company, and the trainer's re-evaluation within 1e-5."""
    from omnirl_core.testing.engines import check_rollout_engine

    samples = check_rollout_engine(lambda m: engine(m), model)
    assert len(samples) == 6


def test_samples_equal_the_diffusers_engines(model):
    """Same requests and seeds through both engines: every plan kind, sigma subsets, shared initial noise."""
    requests = requests_for(PLANS) + requests_for(PLANS[:1] * 2, shared_noise=True)
    for i, r in enumerate(requests):
        r.uid = i
    ours = by_uid(engine(model).generate(requests))
    ref = diffusers_samples(model, requests)
    lat = max(float((ours[u].latents - ref[u].latents).abs().max()) for u in ref)
    lp = max(max_delta(ours[u].logprobs, ref[u].logprobs) for u in ref)
    img = max(float((ours[u].output - ref[u].output).abs().max()) for u in ref)
    print(f"vllm-omni vs diffusers engine: latents {lat:.3g}, log-probs {lp:.3g}, images {img:.3g}")
    assert lat <= 1e-4 and lp <= 1e-4, (lat, lp)
    assert img <= 1e-3
    for u in ref:
        assert torch.equal(ours[u].sigmas, ref[u].sigmas)
    # the two shared-noise samples start from the same latent, then diverge (own step noise)
    a, b = ours[len(PLANS)], ours[len(PLANS) + 1]
    assert torch.equal(a.latents[0], b.latents[0]) and not torch.equal(a.latents[-1], b.latents[-1])


def test_cfg_samples_equal_the_diffusers_engines(model):
    requests = requests_for(PLANS[:2], guidance=4.0)
    ours = by_uid(engine(model).generate(requests))
    ref = diffusers_samples(model, requests)
    lat = max(float((ours[u].latents - ref[u].latents).abs().max()) for u in ref)
    lp = max(max_delta(ours[u].logprobs, ref[u].logprobs) for u in ref)
    print(f"CFG 4.0: latents {lat:.3g}, log-probs {lp:.3g}")
    assert lat <= 1e-4 and lp <= 1e-4, (lat, lp)
    assert all(ours[u].uncond is not None for u in ours)


def test_trainer_recomputes_the_engines_logprobs(model):
    samples = list(engine(model).generate(requests_for(PLANS[:3])))
    delta = trainer_logprob_delta(model, samples)
    print(f"logprob/abs_delta_max (trainer vs vllm-omni) = {delta:.3g}")
    assert delta <= 1e-5, delta


@pytest.mark.parametrize("sync", ["auto", "full"])
def test_a_weight_update_reaches_the_engine(model, sync):
    """After an update, the next rollout's log-probs agree with the trainer's only if the weights were synced."""
    check_weight_update_reaches_engine(model, lambda **o: engine(model, **o), requests_for(PLANS[:2]),
                                       trainer_logprob_delta, sync, seed=3 if sync == "auto" else 4, scale=0.3)


def test_samples_are_complete(model):
    (sample,) = engine(model).generate(requests_for(PLANS[:1]))
    assert sample.latents.shape == (4, 4, 8, 8)
    assert sample.output.shape == (3, 32, 32) and 0.0 <= float(sample.output.min()) <= float(sample.output.max()) <= 1
    assert math.isnan(float(sample.logprobs[2])) and not math.isnan(float(sample.logprobs[0]))
    assert sample.cond.tensors["prompt_embeds"].dtype == torch.float32


def test_a_training_run_through_the_cli(tmp_path):
    """`omnirl train ... --set rollout.engine=vllm-omni` end to end (its own engine start, in the CLI's process):
    every step's rollout log-probs agree with the trainer's, so each LoRA update reached the engine."""
    run = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("omnirl")), "train", "--model", "qwen-image", "--algo",
                           "flowgrpo", "--preset", "tiny", "--steps", "3", "--set", "rollout.engine=vllm-omni",
                           "--output-dir", str(run)], capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    worst = max(r["logprob/abs_delta_max"] for r in rows)
    print(f"omnirl train with rollout.engine=vllm-omni: {len(rows)} steps, logprob/abs_delta_max <= {worst:.3g}")
    assert len(rows) == 3 and worst <= 1e-5, worst
