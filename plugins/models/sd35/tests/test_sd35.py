"""SD3.5 plugin on its tiny presets (medium and large layouts): from_pretrained round trip with and without
T5, the flow-model contract, rollout/trainer log-prob agreement, LoRA in the layout diffusers reads, image
encoding, clear errors, and the real CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omnirl_plugin_sd35.model import SD35Options, create_model, load_pipeline
from omnirl_plugin_sd35.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection
from omnirl_core.errors import UsageError

LAYOUTS = ("medium", "large")
SIZE = 32


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    return {layout: save_tiny(tmp_path_factory.mktemp(f"sd35-{layout}"), layout=layout, seed=3) for layout in LAYOUTS}


def _model(path: Path, layout: str = "medium", lora: bool = True, **options):
    opts = SD35Options(layout=layout, max_sequence_length=16, **options)
    return testing.trainable(create_model(ModelSection(name="sd3.5", preset="tiny", path=str(path)), opts, "cpu"),
                             lora)


def _render(pipe, steps: int = 2):
    return pipe(prompt="a red square", height=SIZE, width=SIZE, num_inference_steps=steps, guidance_scale=4.5,
                output_type="pt", max_sequence_length=16, generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_preset_saves_and_reloads_through_from_pretrained(tiny_dirs, layout: str):
    path = tiny_dirs[layout]
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"):
        assert index[name][0] is not None, name
    pipe = load_pipeline(str(path), torch.float32)
    assert bool(pipe.transformer.config.dual_attention_layers) == (layout == "medium")
    first = _render(pipe)
    assert first.shape == (1, 3, SIZE, SIZE)
    torch.testing.assert_close(first, _render(load_pipeline(str(path), torch.float32)))


def test_without_t5_the_encoder_is_not_loaded_and_its_embedding_part_is_zero(tiny_dirs):
    with_t5 = _model(tiny_dirs["medium"])
    without = _model(tiny_dirs["medium"], use_t5=False)
    assert without.pipeline.text_encoder_3 is None and with_t5.pipeline.text_encoder_3 is not None
    a = with_t5.encode(["a red square"]).tensors
    b = without.encode(["a red square"]).tensors
    assert a["prompt_embeds"].shape == b["prompt_embeds"].shape == (1, 77 + 16, 64)
    torch.testing.assert_close(a["prompt_embeds"][:, :77], b["prompt_embeds"][:, :77])  # the CLIP part
    torch.testing.assert_close(a["pooled_prompt_embeds"], b["pooled_prompt_embeds"])
    assert b["prompt_embeds"][:, 77:].abs().max() == 0 and a["prompt_embeds"][:, 77:].abs().max() > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flow_model_contract(tiny_dirs, layout: str):
    testing.check_flow_model(_model(tiny_dirs[layout], layout), height=SIZE, width=SIZE)


def test_velocity_matches_the_pipelines_own_denoising(tiny_dirs):
    """Our schedule + velocity + Euler steps reproduce StableDiffusion3Pipeline's latents (CFG on)."""
    from omnirl_core.flow.sampler import sample_step

    model = _model(tiny_dirs["medium"], lora=False)
    pipe = model.pipeline
    shape = model.latent_shape(SIZE, SIZE)
    x0 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))
    expected = pipe(prompt="a red square", negative_prompt="", height=SIZE, width=SIZE, num_inference_steps=4,
                    guidance_scale=4.5, latents=x0.clone(), output_type="latent", max_sequence_length=16).images
    cond, uncond = model.encode(["a red square"]), model.encode([""])
    sigmas = model.sigmas(4, shape)
    x = x0
    with torch.no_grad():
        for i in range(4):
            s, s_next = sigmas[i:i + 1], sigmas[i + 1:i + 2]
            x = sample_step("ode", x, model.velocity(x, s, cond, 4.5, uncond), s, s_next, 0.0).prev_sample
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_trainer_reevaluation_equals_rollout_logprob(tiny_dirs, guidance: float):
    testing.check_logprob_consistency(_model(tiny_dirs["medium"]), SIZE, SIZE, guidance_scale=guidance)


def test_lora_checkpoint_loads_into_a_diffusers_pipeline(tiny_dirs, tmp_path: Path):
    model = _model(tiny_dirs["medium"])
    names = {n for n, p in model.denoiser.named_parameters() if p.requires_grad}
    assert any(".attn2." in n for n in names)  # MMDiT-X's second attention is adapted too
    assert any("ff_context" in n for n in names) and any("add_q_proj" in n for n in names)
    testing.check_lora_roundtrip(model, tmp_path / "ckpt",
                                 lambda: load_pipeline(str(tiny_dirs["medium"]), torch.float32),
                                 lambda pipe: _render(pipe, steps=3))


def test_encode_images_inverts_decode_shape_and_is_deterministic(tiny_dirs):
    model = _model(tiny_dirs["medium"])
    images = torch.rand(2, 3, SIZE, SIZE)
    z = model.encode_images(images)
    assert z.shape == (2, *model.latent_shape(SIZE, SIZE)) and z.dtype == torch.float32
    torch.testing.assert_close(model.encode_images(images), z)
    assert model.decode(z).shape == images.shape


def test_layout_mismatch_and_bad_sizes_are_clear_errors(tiny_dirs, tmp_path: Path):
    with pytest.raises(UsageError, match=r"large \(MMDiT, no dual attention\) layout, but model.options.layout"):
        _model(tiny_dirs["large"], "medium")
    with pytest.raises(UsageError, match="no model_index.json"):
        load_pipeline(str(tmp_path), torch.float32)
    model = _model(tiny_dirs["medium"])
    with pytest.raises(UsageError, match="divisible by 8"):
        model.latent_shape(36, SIZE)
    with pytest.raises(UsageError, match="num_frames"):
        model.latent_shape(SIZE, SIZE, 5)


def test_unreachable_hub_id_is_a_clear_error():
    testing.check_unreachable_hub_id("omnirl_plugin_sd35.model:load_pipeline", "stabilityai/stable-diffusion-3.5-medium", "SD3.5")


def test_importing_the_plugin_is_cheap():
    testing.check_import_is_cheap("omnirl_plugin_sd35")


@pytest.mark.parametrize("algo,layout", [("flowgrpo", "medium"), ("dpo", "medium"), ("flowgrpo", "large")])
def test_cli_trains_the_tiny_preset(tmp_path: Path, algo: str, layout: str):
    if algo not in testing.installed_algorithms():
        pytest.skip(f"algorithm plugin '{algo}' is not installed")
    run = tmp_path / "run"
    records = testing.run_train(run, "--model", "sd3.5", "--algo", algo, "--preset", "tiny", "--steps", "2",
                                "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                                "--set", f"model.options.layout={layout}")
    assert [r["step"] for r in records] == [1, 2]
    assert 0.0 < records[0]["reward/color"] < 1.0
    if algo == "flowgrpo":
        assert records[0]["logprob/abs_delta_max"] <= 1e-5
    else:
        assert "dpo/loss" in records[0]
    assert (run / "samples" / "step-000002.png").is_file()
    assert (run / "checkpoints" / "step-000002" / "pytorch_lora_weights.safetensors").is_file()
