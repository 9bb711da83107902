"""The vllm-omni engine on the tiny edit presets (random weights, CPU, fp32): Qwen-Image-Edit-Plus, Qwen-Image-Edit
and FLUX.1 Kontext, condition images encoded by vllm-omni's pipelines, against the diffusers engine and the trainer.

Marked ``engines``: they need the engine's environment (``omnirl env build vllm-omni``) and skip without it. The
tests share one vllm-omni start (one server per process and model) but these: the plain Qwen-Image-Edit test and the
FLUX.1 Kontext test (other checkpoints: their own starts, about 15 s each here) and the last, real ``omnirl train``
processes with their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omnirl_core import testing
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest, RolloutPlan, Sample
from omnirl_core.data.builtin.make_sets import square_pictures
from omnirl_core.errors import UsageError
from omnirl_core.flow.policy_gradient import Transition, transition_stats
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.serving.rollout_server import close_shared_servers

pytestmark = pytest.mark.engines

ETA = 0.7
PROMPTS = ["make the square in the middle red", "turn the square blue and keep the background", "paint it green"]
PLANS = [
    RolloutPlan(step_kinds=("sde", "sde", "ode"), train_steps=(0, 1), eta=ETA),
    RolloutPlan(step_kinds=("cps", "cps", "ode"), train_steps=(0, 1), eta=ETA),
    RolloutPlan(step_kinds=("ode", "dance", "ode"), train_steps=(1,), eta=ETA),
    RolloutPlan(step_kinds=("sde", "dpm2", "dpm2"), train_steps=(0,), eta=ETA, sigma_indices=(0, 1, 3, 5)),
]


def tiny_model(name: str = "qwen-image-edit", **options):
    """A model plugin's tiny preset as `omnirl train --preset tiny` sets it up (qwen-image-edit: its condition-image
    areas from the plugin's omnirl.toml; flux.1-kontext: its source area and T5 length), with a LoRA adapter."""
    spec = get_plugin_manager().resolve("model", name)
    config = spec.load_config()(**spec.preset_defaults["tiny"]["model"]["options"], **options)
    m = spec.load_factory()(ModelSection(name=name, preset="tiny"), config, "cpu")
    m.setup_training(LoraConfig(rank=4, alpha=4), need_reference=False)
    return m


@pytest.fixture(scope="module")
def model():
    testing.require_engine_environment("vllm-omni")
    yield tiny_model()  # Edit-Plus
    close_shared_servers()  # this module's vllm-omni servers (the next module starts its own)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[str]:
    """Sources as builtin:edits draws them (a square of one colour on another, 64 px), and two other sizes whose
    latent grids differ: 64 x 64 -> 4 x 4 tokens, 96 x 32 -> 4 x 8, 32 x 96 -> 8 x 4 (at the tiny preset's area)."""
    folder = tmp_path_factory.mktemp("sources")
    return square_pictures(folder, 64)[:3] + list(testing.write_sources(folder / "sizes", [(96, 32), (32, 96)]))


def engine(model, **options):
    from omnirl_plugin_vllm_omni.engine import VllmOmniRolloutEngine, VllmOmniRolloutOptions

    return VllmOmniRolloutEngine(model, VllmOmniRolloutOptions(**options), torch.device("cpu"))


def requests_for(sources: list[str], guidance: float = 1.0) -> list[GenRequest]:
    """Every plan kind, sources of three sizes and a prompt with two images, in one call; the last request is the
    first with another source of the same size."""
    rows = [(0, [sources[0]], 0), (1, [sources[3]], 1), (2, [sources[4]], 2), (0, [sources[1], sources[3]], 3),
            (0, [sources[2]], 0)]
    return [GenRequest(uid=uid, prompt=PROMPTS[prompt], prompt_index=prompt, group=uid, height=32, width=32,
                       seed=500 + 11 * (uid % 4), plan=PLANS[plan], guidance_scale=guidance, inputs={"image": paths})
            for uid, (prompt, paths, plan) in enumerate(rows)]


def by_uid(samples) -> dict[int, Sample]:
    return {s.request.uid: s for s in samples}


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), "NaN (deterministic-step) log-probs differ in place"
    return float((a[~nan_a] - b[~nan_b]).abs().max()) if (~nan_a).any() else 0.0


def cond_delta(a, b) -> float:
    """Largest difference of two one-row conditionings (prompt embeddings compared over the shorter length)."""
    worst = 0.0
    assert a.layout == b.layout and a.tensors.keys() == b.tensors.keys(), (a.layout, b.layout, sorted(a.tensors))
    for key, x in a.tensors.items():
        y = b.tensors[key]
        n = min(x.shape[1], y.shape[1])
        assert bool((x[:, n:] == 0).all()) and bool((y[:, n:] == 0).all()), key
        worst = max(worst, float((x[:, :n].float() - y[:, :n].float()).abs().max()))
    return worst


def trainer_logprob_delta(model, samples: list[Sample]) -> float:
    """Largest |trainer's recomputed log-prob - rollout's| over the trained steps (logprob/abs_delta_max)."""
    worst = 0.0
    with torch.no_grad():
        for sample in samples:
            for step in sample.request.plan.train_steps:
                _, _, logp, _ = transition_stats(model, [Transition(sample, step)], sample.request.plan.eta)
                worst = max(worst, abs(float(logp[0]) - float(sample.logprobs[step])))
    return worst


def compare_with_diffusers(model, requests) -> tuple[dict[int, Sample], dict[str, float]]:
    ours = by_uid(engine(model).generate(requests))
    diffusers_engine = get_plugin_manager().resolve("engine", "diffusers").load_factory()
    ref = by_uid(diffusers_engine(model, None, "cpu").generate(requests))
    figures = {
        "latents": max(float((ours[u].latents - ref[u].latents).abs().max()) for u in ref),
        "logprobs": max(max_delta(ours[u].logprobs, ref[u].logprobs) for u in ref),
        "images": max(float((ours[u].output - ref[u].output).abs().max()) for u in ref),
        "cond": max(cond_delta(ours[u].cond, ref[u].cond) for u in ref),
    }
    if any(ref[u].uncond is not None for u in ref):
        figures["uncond"] = max(cond_delta(ours[u].uncond, ref[u].uncond) for u in ref)
    for u in ref:
        assert torch.equal(ours[u].sigmas, ref[u].sigmas)
        assert ours[u].cond.layout == model.condition_key(ref[u].request)
    return ours, figures


def test_samples_equal_the_diffusers_engines(model, sources):
    """Same requests, sources and seeds through both engines: vllm-omni's own condition encoding (resize, VAE,
    vision-language encoder) gives the conditioning, trajectories, log-probs and images of the model plugin's."""
    ours, d = compare_with_diffusers(model, requests_for(sources))
    print("vllm-omni vs diffusers engine, edit: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
    assert d["cond"] <= 1e-4 and d["latents"] <= 1e-4 and d["logprobs"] <= 1e-4, d
    assert d["images"] <= 1e-3, d
    layouts = {s.cond.layout for s in ours.values()}
    assert {((4, 4),), ((4, 8),), ((8, 4),), ((4, 4), (4, 8))} <= layouts, layouts  # sizes mixed in one call
    assert all(s.uncond is None for s in ours.values())
    # the source steers the edit: the same prompt, seed and plan with another source ends elsewhere
    assert torch.equal(ours[0].latents[0], ours[4].latents[0])
    assert float((ours[0].latents[-1] - ours[4].latents[-1]).abs().max()) > 1e-3


def test_cfg_samples_equal_the_diffusers_engines(model, sources):
    """True CFG: the negative prompt is encoded with the same images and both branches see the image tokens."""
    ours, d = compare_with_diffusers(model, requests_for(sources, guidance=4.0))
    print("vllm-omni vs diffusers engine, edit with CFG 4.0: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
    assert d["cond"] <= 1e-4 and d["latents"] <= 1e-4 and d["logprobs"] <= 1e-4, d
    for s in ours.values():
        assert s.uncond is not None and s.uncond.layout == s.cond.layout
        assert torch.equal(s.uncond.tensors["image_latents"], s.cond.tensors["image_latents"])


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_trainer_recomputes_the_engines_logprobs(model, sources, guidance):
    """The trainer re-evaluates each transition with the engine's own conditioning (embeddings, image latents,
    layout), its micro-batches grouped by layout."""
    samples = list(engine(model).generate(requests_for(sources, guidance)))
    delta = trainer_logprob_delta(model, samples)
    print(f"edit, CFG {guidance}: logprob/abs_delta_max (trainer vs vllm-omni) = {delta:.3g}")
    assert delta <= 1e-5, delta


def test_a_lora_update_reaches_the_engine(model, sources):
    testing.check_weight_update_reaches_engine(model, lambda **o: engine(model, **o), requests_for(sources)[:3],
                                               trainer_logprob_delta, "auto", seed=5, scale=0.3)


def test_plain_edit_equals_the_diffusers_engine_and_the_trainer(model, sources):
    """Qwen-Image-Edit (one source, which the vision tower sees at the VAE's size): its own vllm-omni start."""
    edit = tiny_model(tiny_variant="edit")
    for guidance in (1.0, 4.0):
        requests = [r for r in requests_for(sources, guidance) if len(r.condition_images) == 1]
        ours, d = compare_with_diffusers(edit, requests)
        d["trainer"] = trainer_logprob_delta(edit, list(ours.values()))
        print(f"Qwen-Image-Edit, CFG {guidance}: vllm-omni vs diffusers engine: "
              + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
        assert d["cond"] <= 1e-4 and d["latents"] <= 1e-4 and d["logprobs"] <= 1e-4 and d["images"] <= 1e-3, d
        assert d["trainer"] <= 1e-5, d


def test_models_it_cannot_run_are_refused(tmp_path):
    from omnirl_plugin_vllm_omni.engine import pipeline_class

    for name, says in (("FluxPipeline", "has no step execution"), ("StableDiffusion3Pipeline", "holds a")):
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": name}))
        with pytest.raises(UsageError, match=says) as info:
            pipeline_class(str(tmp_path))
        assert "rollout.engine=diffusers" in (info.value.hint or "")
    for name in ("QwenImageEditPlusPipeline", "FluxKontextPipeline"):
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": name}))
        assert pipeline_class(str(tmp_path)) == f"Omnirl{name}"


def test_flux_kontext_equals_the_diffusers_engine_and_the_trainer(model, sources):
    """FLUX.1 Kontext (one source, embedded guidance: the scale is the transformer's input, no second branch), its own
    vllm-omni start: vllm-omni's Kontext parts (CLIP + T5 encoders, resize, VAE, packing, ids, transformer) give the
    conditioning, trajectories, log-probs and images of the model plugin's, and the trainer recomputes the log-probs
    from the engine's conditioning (pooled and T5 embeddings, the source's packed latents, the layout)."""
    kontext = tiny_model("flux.1-kontext")
    requests = [r for r in requests_for(sources, guidance=3.5) if len(r.condition_images) == 1]
    ours, d = compare_with_diffusers(kontext, requests)
    d["trainer"] = trainer_logprob_delta(kontext, list(ours.values()))
    print("FLUX.1 Kontext, guidance 3.5: vllm-omni vs diffusers engine: "
          + ", ".join(f"{k} {v:.3g}" for k, v in d.items()))
    assert d["cond"] <= 1e-4 and d["latents"] <= 1e-4 and d["logprobs"] <= 1e-4 and d["images"] <= 1e-3, d
    assert d["uncond"] <= 1e-4 and d["trainer"] <= 1e-5, d
    for s in ours.values():  # with a scale above 1 the samples carry the negative prompt's conditioning
        assert s.uncond is not None and s.uncond.layout == s.cond.layout
        assert torch.equal(s.uncond.tensors["image_latents"], s.cond.tensors["image_latents"])
        assert set(s.cond.tensors) == {"prompt_embeds", "pooled_prompt_embeds", "image_latents"}, sorted(s.cond.tensors)
    assert len({s.cond.layout for s in ours.values()}) == 3  # three source grids, one call
    # the source steers the edit: the same prompt, seed and plan with another source ends elsewhere
    assert torch.equal(ours[0].latents[0], ours[4].latents[0])
    assert float((ours[0].latents[-1] - ours[4].latents[-1]).abs().max()) > 1e-3
    # the guidance scale goes in: another scale, another trajectory
    other = by_uid(engine(kontext).generate(requests_for(sources, guidance=1.5)[:1]))
    assert float((other[0].latents[-1] - ours[0].latents[-1]).abs().max()) > 1e-4
    # a LoRA update reaches vllm-omni's FLUX.1 transformer (loaded from tensors) and only then do the log-probs agree
    testing.check_weight_update_reaches_engine(kontext, lambda **o: engine(kontext, **o), requests[:3],
                                               trainer_logprob_delta, "auto", seed=5, scale=0.3)


@pytest.mark.parametrize("name", ["qwen-image-edit", "flux.1-kontext"])
def test_a_training_run_through_the_cli(tmp_path, name):
    """`omnirl train --model <edit model> ... --set rollout.engine=vllm-omni` end to end on builtin:edits (its own
    engine start): the second step's rollout ran on the synced LoRA, so its log-probs agree with the trainer's."""
    testing.require_engine_environment("vllm-omni")
    run = tmp_path / "run"
    proc = subprocess.run([str(Path(sys.executable).with_name("omnirl")), "train", "--model", name,
                           "--algo", "flowgrpo", "--preset", "tiny", "--set", "data.prompts=builtin:edits",
                           "--set", "rollout.engine=vllm-omni", "--steps", "2", "--output-dir", str(run)],
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    worst = max(r["logprob/abs_delta_max"] for r in rows)
    print(f"omnirl train {name} with rollout.engine=vllm-omni: {len(rows)} steps, "
          f"logprob/abs_delta_max <= {worst:.3g}")
    assert len(rows) == 2 and worst <= 1e-5, worst
