"""FLUX.1 plugin on its tiny presets (dev and schnell architectures): from_pretrained round trip, the core's
flow-model suites (contract, batch invariance, rollout/trainer log-prob agreement, LoRA into FluxPipeline),
FluxPipeline's own denoising reproduced, embedded guidance and its refusal, clear errors, full size on meta."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omnirl_plugin_flux import limits
from omnirl_plugin_flux.model import FluxOptions, create_model
from omnirl_plugin_flux.tiny import build_tiny_pipeline

from omnirl_core import testing
from omnirl_core.config import ModelSection, build_config
from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.flow.model import load_diffusers_pipeline, pack_2x2, save_pipeline
from omnirl_core.testing.forkserver import run_omnirl

VARIANTS = ("dev", "schnell")
SIZE = 32


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    return {v: save_pipeline(build_tiny_pipeline(v, seed=3), tmp_path_factory.mktemp(f"flux-{v}")) for v in VARIANTS}


def _load(path: Path):
    from diffusers import FluxPipeline

    return load_diffusers_pipeline(FluxPipeline, str(path), torch.float32, "FLUX.1")


def _model(path: Path, lora: bool = True, **options):
    options = FluxOptions(max_sequence_length=16, **options)
    return testing.trainable(create_model(ModelSection(name="flux.1", path=str(path)), options, "cpu"), lora)


def _render(pipe, steps: int = 2):
    return testing.render(pipe, steps, height=SIZE, width=SIZE, guidance_scale=3.5, max_sequence_length=16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_preset_reloads_through_from_pretrained_and_runs_the_core_suites(tiny_dirs, variant: str):
    index = json.loads((tiny_dirs[variant] / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and index["text_encoder_2"][1] == "T5EncoderModel"
    first = _render(_load(tiny_dirs[variant]))
    torch.testing.assert_close(first, _render(_load(tiny_dirs[variant])))
    model = _model(tiny_dirs[variant])
    assert model.guidance == ("embedded" if variant == "dev" else "none")
    if variant == "schnell":  # dev: every suite in test_dev_passes_every_model_suite
        testing.check_flow_model(model, height=SIZE, width=SIZE)
        testing.check_logprob_consistency(model, SIZE, SIZE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_velocity_reproduces_flux_pipeline_denoising(tiny_dirs, variant: str):
    """Our schedule + velocity (with the embedded guidance) + Euler steps give FluxPipeline's latents."""
    from omnirl_core.flow.sampler import sample_step

    model = _model(tiny_dirs[variant], lora=False)
    shape = model.latent_shape(SIZE, SIZE)
    x0 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))
    scale = 3.5 if variant == "dev" else 1.0
    expected = model.pipeline(prompt="a red square", height=SIZE, width=SIZE, num_inference_steps=4,
                              guidance_scale=scale, latents=pack_2x2(x0), output_type="latent",
                              max_sequence_length=16).images
    cond, sigmas, x = model.encode(["a red square"]), model.sigmas(4, shape), x0
    with torch.no_grad():
        for i in range(4):
            s, s_next = sigmas[i:i + 1], sigmas[i + 1:i + 2]
            x = sample_step("ode", x, model.velocity(x, s, cond, scale), s, s_next, 0.0).prev_sample
    torch.testing.assert_close(pack_2x2(x), expected, atol=1e-5, rtol=1e-5)


def test_dev_passes_every_model_suite(tiny_dirs, tmp_path: Path):
    """``check_model_plugin``: the contract, log-prob agreement with embedded guidance, the LoRA round trip into
    FluxPipeline, and gradient checkpointing (same gradients, fewer activations kept)."""
    model = _model(tiny_dirs["dev"])
    names = {n for n, p in model.denoiser.named_parameters() if p.requires_grad}
    assert any("single_transformer_blocks" in n and "proj_mlp" in n for n in names)  # single blocks are adapted
    assert any("ff_context" in n for n in names) and any("add_q_proj" in n for n in names)
    testing.check_model_plugin(
        lambda gradient_checkpointing: _model(tiny_dirs["dev"], gradient_checkpointing=gradient_checkpointing),
        SIZE, SIZE, guidance_scale=3.5, directory=tmp_path / "ckpt", load_pipeline=lambda: _load(tiny_dirs["dev"]),
        render=lambda pipe: _render(pipe, 3),
        blocks=lambda m: [*m.denoiser.transformer_blocks, *m.denoiser.single_transformer_blocks], large_size=64)


def test_guidance_the_model_cannot_use_is_refused_before_loading(tiny_dirs):
    from omnirl_core.registry import ModelSpec
    from omnirl_core.resolve import check_model_limits

    spec = ModelSpec(name="flux.1", factory="omnirl_plugin_flux.model:create_model", limits="omnirl_plugin_flux:limits")

    def config(**model):
        return build_config({"model": {"name": "flux.1", **model}, "rollout": {"guidance_scale": 3.5, "height": 32,
                                                                                "width": 32}})
    check_model_limits(config(preset="tiny"), spec, FluxOptions())  # dev: embedded guidance takes any scale
    for model in ({"preset": "schnell"}, {"path": str(tiny_dirs["schnell"])}, {"path": "acme/FLUX.1-schnell-copy"}):
        with pytest.raises(ConfigError) as info:
            check_model_limits(config(**model), spec, FluxOptions())
        assert "has no guidance" in "\n".join(info.value.details), model
    assert limits(ModelSection(path=str(tiny_dirs["dev"])), None).guidance == "embedded"
    assert limits(ModelSection(preset="dev"), None).size_multiple == 16
    with pytest.raises(UsageError, match="has no guidance"):
        schnell = _model(tiny_dirs["schnell"])
        schnell.velocity(torch.zeros(1, *schnell.latent_shape(SIZE, SIZE)), torch.tensor([0.5]),
                         schnell.encode(["a"]), 3.5)


def test_dry_run_refuses_sizes_and_guidance_without_loading_weights(tmp_path: Path):
    env = {**os.environ, "OMNIRL_CACHE": str(tmp_path / "cache")}  # an empty cache: nothing may be built
    out = run_omnirl(["train", "--model", "flux.1", "--algo", "flowgrpo", "--preset", "schnell",
                      "--dry-run", "--set", "rollout.height=520", "--set", "rollout.guidance_scale=3.5"],
                      timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rollout.height/width = 520x512, but flux.1 needs multiples of 16" in out.stderr
    assert "has no guidance" in out.stderr
    typo = run_omnirl(["train", "--model", "flux.1", "--algo", "flowgrpo", "--preset", "tiny",
                       "--dry-run", "--set", "model.options.max_sequence_lenght=8"], timeout=120, env=env)
    assert typo.returncode == 2 and "max_sequence_length" in typo.stderr
    assert "models flux.1 --options`" in typo.stderr  # the command that lists the model's options
    assert not (tmp_path / "cache" / "presets").exists()


def test_encode_images_inverts_decode_shape(tiny_dirs):
    model = _model(tiny_dirs["dev"])
    images = torch.rand(2, 3, SIZE, SIZE)
    z = model.encode_images(images)
    assert z.shape == (2, *model.latent_shape(SIZE, SIZE)) and z.dtype == torch.float32
    assert model.decode(z).shape == images.shape


def test_hub_presets_offline_are_a_clear_error():
    text = testing.offline_error("from omnirl_plugin_flux.model import create_model\n"
                         "from omnirl_core.config import ModelSection",
                         "create_model(ModelSection(name='flux.1', preset='schnell'), None, 'cpu')")
    assert text.startswith("Could not load FLUX.1 from 'black-forest-labs/FLUX.1-schnell'"), text
    assert "--preset tiny" in text


def test_importing_the_plugin_is_cheap():
    code = "import sys, omnirl_plugin_flux; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_size_parameter_counts_match_the_published_figures(variant: str):
    from omnirl_plugin_flux.full_size import PUBLISHED, full_size_components, parameter_counts

    components, seconds, grown_mib = testing.build_on_meta(lambda: full_size_components(variant))
    testing.check_on_meta(components, seconds, grown_mib)  # 17 billion fp32 parameters would be 68 GB
    counts = parameter_counts(variant, components)
    for (v, name), published in PUBLISHED.items():
        if v == variant:
            assert testing.matches_published(counts[name], published), (name, counts[name], published)
    assert counts["transformer"] > 11.8e9 and len(components["transformer"].single_transformer_blocks) == 38
