"""Wan2.2 plugin on its tiny presets (both layouts): from_pretrained round trip, the flow-model contract,
expert routing by sigma, rollout/trainer log-prob agreement, LoRA and full weights in the layouts diffusers
reads, clear errors, and the real CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omnirl_plugin_wan22.model import LORA_FILES, Wan22Options, create_model, load_pipeline
from omnirl_plugin_wan22.tiny import save_tiny

from omnirl_core import testing
from omnirl_core.config import ModelSection
from omnirl_core.errors import UsageError

LAYOUTS = ("a14b", "ti2v-5b")
SIZE, FRAMES = 16, 5


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    return {layout: save_tiny(tmp_path_factory.mktemp(f"wan-{layout}"), layout=layout, seed=3) for layout in LAYOUTS}


def _model(path: Path, layout: str, lora: bool = True, **options):
    opts = Wan22Options(layout=layout, max_sequence_length=16, **options)
    return testing.trainable(create_model(ModelSection(name="wan2.2", preset="tiny", path=str(path)), opts, "cpu"),
                             lora)


def _render(pipe, steps: int = 2):
    return pipe(prompt="a red square", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=steps,
                guidance_scale=1.0, output_type="pt", max_sequence_length=16,
                generator=torch.Generator().manual_seed(0)).frames


def test_importing_the_plugin_is_cheap():
    testing.check_import_is_cheap("omnirl_plugin_wan22")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_preset_saves_and_reloads_through_from_pretrained(tiny_dirs, layout: str):
    path = tiny_dirs[layout]
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert (index["transformer_2"][0] is not None) == (layout == "a14b")
    assert index["boundary_ratio"] == (0.875 if layout == "a14b" else None)
    assert index["expand_timesteps"] == (layout == "ti2v-5b")
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    pipe = load_pipeline(str(path), torch.float32)
    assert pipe.vae.config.z_dim == (16 if layout == "a14b" else 48)
    first = _render(pipe)
    assert first.shape == (1, FRAMES, 3, SIZE, SIZE)
    torch.testing.assert_close(first, _render(load_pipeline(str(path), torch.float32)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flow_model_contract(tiny_dirs, layout: str):
    model = _model(tiny_dirs[layout], layout)
    testing.check_flow_model(model, height=SIZE, width=SIZE, num_frames=FRAMES)
    shape = model.latent_shape(SIZE, SIZE, FRAMES)
    assert len(shape) == 4 and shape[0] == model.z_dim  # (C, T, H, W)
    assert model.decode(torch.randn(2, *shape)).shape == (2, 3, FRAMES, SIZE, SIZE)


def test_a14b_velocity_routes_every_sample_to_the_expert_of_its_sigma(tiny_dirs):
    """WanPipeline's rule per sample: sigma >= boundary -> transformer (high noise), else transformer_2."""
    model = _model(tiny_dirs["a14b"], "a14b", lora=False)
    assert model.boundary == pytest.approx(0.875)
    shape = model.latent_shape(SIZE, SIZE, FRAMES)
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.95, 0.5, 0.875, 0.1])
    cond = model.encode(["a red square", "a blue car", "a cat", "a dog"])
    with torch.no_grad():
        mixed = model.velocity(x, sigma, cond)
        for i, expert in enumerate(["transformer", "transformer_2", "transformer", "transformer_2"]):
            alone = model._forward(model.experts[expert], x[i:i + 1], sigma[i:i + 1], cond.select([i]))
            torch.testing.assert_close(mixed[i:i + 1], alone, atol=1e-5, rtol=0)
        # changing the low-noise expert changes the low-noise samples only
        for p in model.experts["transformer_2"].parameters():
            p.add_(0.05)
        after = model.velocity(x, sigma, cond)
    assert (after[[1, 3]] - mixed[[1, 3]]).abs().max() > 1e-3
    torch.testing.assert_close(after[[0, 2]], mixed[[0, 2]])


def test_a14b_gradients_reach_both_experts_from_one_mixed_batch(tiny_dirs):
    model = _model(tiny_dirs["a14b"], "a14b")
    shape = model.latent_shape(SIZE, SIZE, FRAMES)
    x = torch.randn(2, *shape)
    cond = model.encode(["a red square", "a blue car"])
    with torch.no_grad():  # move the LoRA B matrices off zero so both adapters pass gradients to A too
        for p in model.trainable_parameters():
            p.add_(0.01)
    model.velocity(x, torch.tensor([0.9, 0.3]), cond).pow(2).mean().backward()
    for name in ("transformer", "transformer_2"):
        grads = [p.grad for p in model.experts[name].parameters() if p.requires_grad]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), name


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_dirs):
    grads = []
    for checkpointing in (False, True):
        model = _model(tiny_dirs["a14b"], "a14b", gradient_checkpointing=checkpointing)
        assert model.experts["transformer_2"].gradient_checkpointing == checkpointing
        with torch.no_grad():
            for p in model.trainable_parameters():
                p.copy_(torch.full_like(p, 0.01))
        x = torch.randn(2, *model.latent_shape(SIZE, SIZE, FRAMES), generator=torch.Generator().manual_seed(2))
        model.velocity(x, torch.tensor([0.9, 0.3]), model.encode(["a red square"] * 2)).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.trainable_parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_a_single_module_engine_is_refused_when_both_experts_train(tiny_dirs):
    with pytest.raises(UsageError, match="leave the low-noise expert untrained") as info:
        _ = _model(tiny_dirs["a14b"], "a14b").denoiser
    assert "train_experts=high or low" in info.value.hint
    assert _model(tiny_dirs["ti2v-5b"], "ti2v-5b").denoiser is not None


@pytest.mark.parametrize("layout,guidance", [("a14b", 1.0), ("a14b", 4.0), ("ti2v-5b", 1.0), ("ti2v-5b", 4.0)])
def test_trainer_reevaluation_equals_rollout_logprob(tiny_dirs, layout: str, guidance: float):
    """With unchanged weights the trainer's log-prob of every stored video transition equals the rollout's
    to 1e-5, also when a micro-batch mixes steps of both experts."""
    model = _model(tiny_dirs[layout], layout, guidance_scale_2=3.0 if layout == "a14b" else None)
    sigmas = model.sigmas(6, model.latent_shape(SIZE, SIZE, FRAMES))[:-2]
    if layout == "a14b":  # the trained steps span both experts
        assert (sigmas >= 0.875).any() and (sigmas < 0.875).any(), sigmas
    testing.check_logprob_consistency(model, SIZE, SIZE, FRAMES, guidance_scale=guidance, steps=6)


def test_low_noise_guidance_scale_applies_to_the_low_noise_expert_only(tiny_dirs):
    base = _model(tiny_dirs["a14b"], "a14b")
    other = _model(tiny_dirs["a14b"], "a14b", guidance_scale_2=1.5)
    shape = base.latent_shape(SIZE, SIZE, FRAMES)
    x = torch.randn(2, *shape)
    sigma = torch.tensor([0.95, 0.3])
    cond = base.encode(["a red square"] * 2)
    uncond = base.encode([" "] * 2)
    with torch.no_grad():
        a = base.velocity(x, sigma, cond, 4.0, uncond)
        b = other.velocity(x, sigma, cond, 4.0, uncond)
    torch.testing.assert_close(a[0], b[0])
    assert (a[1] - b[1]).abs().max() > 1e-4


def _perturb(model, scale: float = 0.3) -> None:
    """Stand-in for training: move the trained weights away from their init."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_a14b_lora_of_both_experts_loads_into_a_wan_pipeline(tiny_dirs, tmp_path: Path):
    def load_both(pipe, directory):
        pipe.load_lora_weights(str(directory))
        pipe.load_lora_weights(str(directory), weight_name=LORA_FILES["transformer_2"], load_into_transformer_2=True)

    model = _model(tiny_dirs["a14b"], "a14b")
    testing.check_lora_roundtrip(model, tmp_path / "ckpt", lambda: load_pipeline(str(tiny_dirs["a14b"]), torch.float32),
                                 lambda pipe: _render(pipe, steps=4), load_both)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(LORA_FILES.values())


def test_a14b_training_only_the_low_noise_expert(tiny_dirs, tmp_path: Path):
    model = _model(tiny_dirs["a14b"], "a14b", train_experts="low")
    trained = {id(p) for p in model.trainable_parameters()}
    assert trained == {id(p) for p in model.experts["transformer_2"].parameters() if p.requires_grad}
    assert not any(p.requires_grad for p in model.experts["transformer"].parameters())
    assert model.save_trained(tmp_path / "ckpt") == [LORA_FILES["transformer_2"]]
    assert model.denoiser is model.experts["transformer_2"]  # what a single-module engine shards


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_finetune_saves_loadable_experts_and_resumes(tiny_dirs, layout: str, tmp_path: Path):
    from diffusers import WanTransformer3DModel

    model = _model(tiny_dirs[layout], layout, lora=False)
    shape = model.latent_shape(SIZE, SIZE, FRAMES)
    x, sigma, cond = torch.randn(2, *shape), torch.tensor([0.95, 0.3]), model.encode(["a red square"] * 2)
    _perturb(model, 0.01)
    with torch.no_grad():
        trained_v = model.velocity(x, sigma, cond)
        with model.reference():
            ref_v = model.velocity(x, sigma, cond)
    assert (trained_v - ref_v).abs().max() > 1e-4  # the reference is the frozen base copy
    files = model.save_trained(tmp_path / "ckpt")
    experts = ["transformer", "transformer_2"] if layout == "a14b" else ["transformer"]
    assert files == [f"{name}/" for name in experts]
    for name in experts:
        loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "ckpt" / name))
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(value, model.experts[name].state_dict()[key])
    fresh = _model(tiny_dirs[layout], layout, lora=False)
    fresh.load_trained(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), trained_v)


def test_layout_mismatch_and_bad_sizes_are_clear_errors(tiny_dirs, tmp_path: Path):
    with pytest.raises(UsageError, match=r"ti2v-5b \(one transformer\) layout, but model.options.layout is 'a14b'"):
        _model(tiny_dirs["ti2v-5b"], "a14b")
    with pytest.raises(UsageError, match="no model_index.json"):
        load_pipeline(str(tmp_path), torch.float32)
    model = _model(tiny_dirs["a14b"], "a14b")
    with pytest.raises(UsageError, match="2k\\+1 frames"):
        model.latent_shape(SIZE, SIZE, 4)
    with pytest.raises(UsageError, match="num_frames"):
        model.latent_shape(SIZE, SIZE, None)
    with pytest.raises(UsageError, match="divisible by 8"):
        model.latent_shape(20, SIZE, FRAMES)


def test_video_rewards_resolve_and_image_only_rewards_are_refused():
    """Resolution pairs a reward with the model by modality: colour scores images and videos, JPEG only images."""
    from omnirl_core.errors import PluginError
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_wan22", "omnirl_plugin_flowgrpo", "omnirl_plugin_diffusers",
                          "omnirl_plugin_torch", "omnirl_plugin_color", "omnirl_plugin_jpeg"])
    layer = {"model": {"name": "wan22", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"}}
    resolved = resolve_run(manager, [{**layer, "rewards": [{"name": "color"}]}], probe_device=False)
    assert resolved.model.name == "wan2.2" and resolved.config.rollout.num_frames == FRAMES
    with pytest.raises(PluginError, match="Reward 'jpeg' scores image outputs, but model 'wan2.2' makes video"):
        resolve_run(manager, [{**layer, "rewards": [{"name": "jpeg"}]}], probe_device=False)


def test_unreachable_hub_id_is_a_clear_error():
    testing.check_unreachable_hub_id("omnirl_plugin_wan22.model:load_pipeline", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "Wan2.2")


@pytest.mark.parametrize("algo,layout", [("flowgrpo", "a14b"), ("dancegrpo", "a14b"), ("flowgrpo", "ti2v-5b")])
def test_cli_trains_the_tiny_preset(tmp_path: Path, algo: str, layout: str):
    """The real CLI end to end on video: rollout, colour reward on every frame, update, LoRA checkpoint,
    frame-strip PNG and animated GIF samples; the first update sees the rollout's own log-probs."""
    if algo not in testing.installed_algorithms():
        pytest.skip(f"algorithm plugin '{algo}' is not installed")
    run = tmp_path / "run"
    records = testing.run_train(run, "--model", "wan2.2", "--algo", algo, "--preset", "tiny", "--steps", "2",
                                "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                                "--set", f"model.options.layout={layout}", "--set", "run.sample_every=2")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["logprob/abs_delta_max"] <= 1e-5
    assert 0.0 < records[0]["reward/color"] < 1.0
    from PIL import Image

    gif = Image.open(run / "samples" / "step-000002.gif")
    assert gif.n_frames == FRAMES
    ckpt = run / "checkpoints" / "step-000002"
    expected = set(LORA_FILES.values()) if layout == "a14b" else {LORA_FILES["transformer"]}
    assert expected <= {p.name for p in ckpt.iterdir()}
