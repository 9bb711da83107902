"""FLUX.1 Kontext on its tiny preset (FLUX.1-dev's architecture saved as a FluxKontextPipeline): from_pretrained round
trip, the core's flow-model suites with source images (contract, batch invariance, rollout/trainer log-prob agreement
with embedded guidance, sources of two sizes in one micro-batch), FluxKontextPipeline's own editing reproduced, the
LoRA loaded into FluxKontextPipeline, the plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from omnirl_plugin_flux.model import FluxKontextModel, FluxKontextOptions, create_kontext_model
from omnirl_plugin_flux.tiny import build_tiny_pipeline
from PIL import Image

from omnirl_core import testing
from omnirl_core.config import ModelSection
from omnirl_core.contracts import RolloutPlan
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import load_diffusers_pipeline, pack_2x2, save_pipeline

SIZE = 32
OPTIONS = {"max_sequence_length": 16, "condition_area": SIZE * SIZE}  # the tiny preset's (omnirl.toml)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_pipeline(build_tiny_pipeline("kontext", seed=3), tmp_path_factory.mktemp("kontext"))


@pytest.fixture(scope="module")
def loaded(tiny_dir) -> FluxKontextModel:
    return create_kontext_model(ModelSection(name="flux.1-kontext", path=str(tiny_dir)), FluxKontextOptions(**OPTIONS),
                                "cpu")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[str, ...]:
    """Sources whose latent grids differ at 32 x 32 pixels: 64 x 64 (-> 32 x 32) and 128 x 32 (-> 64 x 16)."""
    return testing.write_sources(tmp_path_factory.mktemp("sources"), [(64, 64), (128, 32)])


def _model(base: FluxKontextModel, lora: bool = True, **options) -> FluxKontextModel:
    model = FluxKontextModel(copy.deepcopy(base.pipeline), FluxKontextOptions(**OPTIONS, **options), base.device,
                             base.dtype)
    return testing.trainable(model, lora)


def _load(path: Path):
    from diffusers import FluxKontextPipeline

    return load_diffusers_pipeline(FluxKontextPipeline, str(path), torch.float32, "FLUX.1 Kontext")


def _render(pipe, image: str, steps: int = 2):
    source = pipe.image_processor.resize(Image.open(image).convert("RGB"), SIZE, SIZE)  # the tiny preset's source size
    return testing.render(pipe, steps, image=source, height=SIZE, width=SIZE, max_area=SIZE * SIZE,
                          _auto_resize=False, guidance_scale=3.5, max_sequence_length=16)


def test_tiny_preset_reloads_and_passes_every_model_suite_with_sources(tiny_dir, loaded, images, tmp_path: Path):
    """The layout of a released Kontext checkpoint; ``check_model_plugin`` with sources of two sizes: the contract,
    log-prob agreement with embedded guidance (3.5), the LoRA round trip into FluxKontextPipeline (it changes the
    pipeline's edit of the same source), gradient checkpointing."""
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline" and index["transformer"][1] == "FluxTransformer2DModel"
    assert loaded.guidance == "embedded" and loaded.condition_images == 1
    torch.testing.assert_close(_render(_load(tiny_dir), images[0]), _render(_load(tiny_dir), images[0]))
    testing.check_model_plugin(
        lambda gradient_checkpointing: _model(loaded, gradient_checkpointing=gradient_checkpointing),
        SIZE, SIZE, guidance_scale=3.5, directory=tmp_path / "ckpt", load_pipeline=lambda: _load(tiny_dir),
        render=lambda pipe: _render(pipe, images[0], 3), images=images,
        blocks=lambda m: [*m.denoiser.transformer_blocks, *m.denoiser.single_transformer_blocks], large_size=64)


def test_velocity_reproduces_flux_kontext_pipeline(loaded, images):
    """Our conditioning (text, the source's packed latents and rotary ids) + schedule + velocity with the embedded
    guidance + Euler steps give FluxKontextPipeline's latents for the same source and initial noise, exactly."""
    from omnirl_core.flow.sampler import sample_step

    model = _model(loaded, lora=False)
    shape = model.latent_shape(SIZE, SIZE)
    x0 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))
    source = model.pipeline.image_processor.resize(Image.open(images[0]).convert("RGB"), SIZE, SIZE)
    expected = model.pipeline(image=source, prompt="make the square red", height=SIZE, width=SIZE,
                              max_area=SIZE * SIZE, _auto_resize=False, num_inference_steps=4, guidance_scale=3.5,
                              latents=pack_2x2(x0), output_type="latent", max_sequence_length=16).images
    [cond] = model.encode_with_images(["make the square red"], [(images[0],)])
    sigmas, x = model.sigmas(4, shape), x0
    with torch.no_grad():
        for i in range(4):
            s, s_next = sigmas[i:i + 1], sigmas[i + 1:i + 2]
            x = sample_step("ode", x, model.velocity(x, s, cond, 3.5), s, s_next, 0.0).prev_sample
    assert torch.equal(pack_2x2(x), expected)


def test_the_trainer_recomputes_the_rollouts_log_probs_bit_for_bit(loaded, images):
    from omnirl_core.flow.policy_gradient import Transition, transition_stats

    model = _model(loaded)
    plan = RolloutPlan(step_kinds=("sde", "sde", "ode"), train_steps=(0, 1), eta=0.7)
    prompts = ["make the square red", "make the square red", "paint it green", "paint it green"]
    samples = testing.rollout(model, testing._requests(prompts, SIZE, SIZE, None, plan, 3.5, 7, images[:1]))
    assert all(s.cond.layout == ((4, 4),) and "image_latents" in s.cond.tensors for s in samples)
    with torch.no_grad():
        for step in plan.train_steps:
            logp = transition_stats(model, [Transition(s, step) for s in samples], plan.eta)[2]
            assert torch.equal(logp, torch.stack([s.logprobs[step] for s in samples])), step


def test_source_sizes_and_refusals(loaded, images):
    model = loaded
    request = testing._requests(["p", "p"], SIZE, SIZE, None, RolloutPlan(("ode",), ()), 1.0, 0, images)
    assert [model.condition_key(r) for r in request] == [((4, 4),), ((2, 8),)]
    assert [row.layout for row in model.encode_with_images(["p", "p"], [(i,) for i in images])] == [((4, 4),), ((2, 8),)]
    preferred = FluxKontextModel(model.pipeline, FluxKontextOptions(max_sequence_length=16), model.device, model.dtype)
    assert preferred._source_size(64, 64) == (1024, 1024) and preferred._source_size(128, 32) == (1568, 672)
    with pytest.raises(UsageError, match="one source image per prompt"):
        model.encode_with_images(["p"], [images])


def test_the_tiny_encoder_tells_sources_apart_at_the_noisy_tokens_scale(loaded, tmp_path: Path):
    """The tiny VAE's encoder is scaled (tiny v2) so that sources encode, after the pipeline's shift and scale, to
    unit-scale tokens like the unit Gaussian noisy tokens beside them; v1's random encoder gave every source nearly
    the same tokens (a spread near 0.1 per channel), so the edit could not see what to keep. Sources: flat and
    two-colour pictures of the builtin edits' colours, other pictures than the ones the scale was measured on."""
    from omnirl_core.data.builtin.make_sets import square_pictures

    paths = square_pictures(tmp_path, SIZE)
    rows = loaded.encode_with_images(["p"] * len(paths), [(p,) for p in paths])
    latents = torch.cat([row.tensors["image_latents"] for row in rows])  # (N, tokens, C * 4), 2 x 2 packed
    channels = latents.view(len(paths), -1, loaded.latent_channels, 4).transpose(1, 2).flatten(2)  # (N, C, values)
    std = channels.std(dim=(0, 2))
    assert bool((std > 0.4).all() and (std < 2.5).all()), std
    assert float(channels.mean(dim=(0, 2)).abs().max()) < 0.8, channels.mean(dim=(0, 2))
    # sources differ by as much as the tokens vary: the spread across sources at each position is unit-scale too
    assert float(latents.std(dim=0).mean()) > 0.3


def test_plan_counts_the_source_tokens():
    from omnirl_core.config import build_config
    from omnirl_core.registry import load_object

    sizing = load_object("omnirl_plugin_flux.sizing:kontext_sizing")
    config = build_config({"model": {"name": "flux.1-kontext"}, "rollout": {"height": 512, "width": 512}})
    released = sizing(config, FluxKontextOptions())
    assert released.components["transformer"] > 11_000_000_000 and "4096 transformer tokens" in released.notes[-1]
    assert "1024 transformer tokens" in sizing(config, FluxKontextOptions(condition_area=512 * 512)).notes[-1]
