"""Qwen-Image-Edit plugin on its tiny presets (Edit-Plus and Edit layouts): from_pretrained round trip, the core's
flow-model suites with condition images (contract, batch invariance, rollout/trainer log-prob agreement with and
without true CFG, condition layouts of two sizes in one micro-batch), diffusers' own edit pipelines reproduced, the
LoRA loaded into QwenImageEditPlusPipeline, and clear errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from omnirl_plugin_qwen_image_edit.model import (
    QwenImageEditModel,
    QwenImageEditOptions,
    create_model,
    load_pipeline,
)
from omnirl_plugin_qwen_image_edit.tiny import build_tiny_pipeline, save_pipeline
from PIL import Image

from omnirl_core import testing
from omnirl_core.config import ModelSection
from omnirl_core.contracts import GenRequest, RolloutPlan
from omnirl_core.errors import UsageError
from omnirl_core.flow.model import pack_2x2

SIZE = 32
AREAS = {"vae_image_area": SIZE * SIZE, "vl_image_area": 56 * 56}  # the tiny preset's (omnirl.toml)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_pipeline(build_tiny_pipeline("edit-plus", seed=3), tmp_path_factory.mktemp("qwen-edit-plus"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[str, ...]:
    """Two condition images whose latent grids differ: 64 x 64 (-> 32 x 32, 4 x 4 tokens) and 96 x 32 (-> 64 x 32)."""
    return testing.write_sources(tmp_path_factory.mktemp("sources"), [(64, 64), (96, 32)])


@pytest.fixture
def tiny_pipeline_sizes(monkeypatch):
    """diffusers' edit pipelines at the tiny preset's sizes (their 1024 x 1024 / 384 x 384 are module constants)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", AREAS["vae_image_area"])
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", AREAS["vl_image_area"])
    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(AREAS["vae_image_area"], ratio))


@pytest.fixture(scope="module")
def loaded(tiny_dir) -> dict[str, QwenImageEditModel]:
    """The tiny checkpoint loaded once through the plugin's factory, and its components as a QwenImageEditPipeline (the
    layouts differ in the pipeline class only, as ``tiny.build_tiny_pipeline`` builds them); ``_model`` copies one."""
    from diffusers import QwenImageEditPipeline

    plus = create_model(ModelSection(name="qwen-image-edit", path=str(tiny_dir)), QwenImageEditOptions(**AREAS), "cpu")
    edit = QwenImageEditPipeline(**{k: getattr(plus.pipeline, k) for k in plus.pipeline.components})
    return {"edit-plus": plus, "edit": QwenImageEditModel(edit, plus.options, plus.device, plus.dtype)}


def _model(base: QwenImageEditModel, lora: bool = True, **options):
    options = QwenImageEditOptions(**AREAS, **options)
    return testing.trainable(QwenImageEditModel(copy.deepcopy(base.pipeline), options, base.device, base.dtype), lora)


def _render(pipe, image: str, steps: int = 2, **kwargs):
    return testing.render(pipe, steps, image=Image.open(image).convert("RGB"), height=SIZE, width=SIZE, **kwargs)


def test_tiny_preset_is_the_released_layout(tiny_dir, loaded):
    """The saved preset reads like a released checkpoint (``loaded`` came through ``from_pretrained``)."""
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert (tiny_dir / "processor" / "preprocessor_config.json").is_file()
    assert type(loaded["edit-plus"].pipeline).__name__ == "QwenImageEditPlusPipeline"
    model = loaded["edit"]
    assert (model.layout, model.condition_images) == ("edit", 1)
    with pytest.raises(UsageError, match="takes one condition image"):
        model.encode(["a prompt without a source"])


def test_edit_plus_passes_every_model_suite_with_condition_images(tiny_dir, loaded, images, tmp_path: Path,
                                                                  tiny_pipeline_sizes):
    """``check_model_plugin`` with condition images of two sizes (the trainer's micro-batches mix their layouts):
    rollout and trainer log-probs agree with true CFG (4.0) to 1e-5 (without CFG, and bit for bit: below); the LoRA
    loads into QwenImageEditPlusPipeline and changes its edit of the same source."""
    build = lambda gradient_checkpointing: _model(loaded["edit-plus"],
                                                  gradient_checkpointing=gradient_checkpointing)
    testing.check_model_plugin(
        build, SIZE, SIZE, guidance_scale=4.0, directory=tmp_path / "ckpt",
        load_pipeline=lambda: load_pipeline(str(tiny_dir), torch.float32),
        render=lambda pipe: _render(pipe, images[0], 3), images=images)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_trainer_recomputes_the_rollouts_log_probs_bit_for_bit(loaded, images, scale: float):
    """The trainer re-evaluates a step's transitions with the conditioning the rollout used (the source's latents and
    the prompt embedding with the source, carried in ``Sample.cond`` / ``uncond``): batched as the rollout batched
    them, the log-probs are the very same numbers, with true CFG and without (re-batched otherwise: to 1e-5 above)."""
    from omnirl_core.flow.policy_gradient import Transition, transition_stats

    model = _model(loaded["edit-plus"])
    plan = RolloutPlan(step_kinds=("sde", "ode"), train_steps=(0,), eta=0.7)
    prompts = ["make the square red", "paint it green"]
    samples = testing.rollout(model, testing._requests(prompts, SIZE, SIZE, None, plan, scale, 7, images[:1]))
    assert all(s.cond.layout == ((4, 4),) and "image_latents" in s.cond.tensors for s in samples)
    assert samples[0].uncond is (None if scale == 1.0 else samples[0].uncond) and (scale == 1.0) == (samples[0].uncond is None)
    with torch.no_grad():
        for step in plan.train_steps:
            logp = transition_stats(model, [Transition(s, step) for s in samples], plan.eta)[2]
            assert torch.equal(logp, torch.stack([s.logprobs[step] for s in samples])), step


@pytest.mark.parametrize("variant", ["edit-plus", "edit"])
def test_velocity_reproduces_the_diffusers_edit_pipeline(loaded, images, variant: str, tiny_pipeline_sizes):
    """Our conditioning (prompt with the source, its VAE latents) + schedule + velocity with true CFG + Euler steps
    give the pipeline's latents for the same source, instruction and initial noise."""
    from omnirl_core.flow.sampler import sample_step

    model = _model(loaded[variant], lora=False)
    shape = model.latent_shape(SIZE, SIZE)
    x0 = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))
    source = Image.open(images[0]).convert("RGB")
    expected = model.pipeline(image=source, prompt="make the square red", negative_prompt=" ", true_cfg_scale=4.0,
                              height=SIZE, width=SIZE, num_inference_steps=3, latents=pack_2x2(x0),
                              output_type="latent").images
    [cond] = model.encode_with_images(["make the square red"], [(images[0],)])
    [uncond] = model.encode_with_images([" "], [(images[0],)])
    sigmas, x = model.sigmas(3, shape), x0
    with torch.no_grad():
        for i in range(3):
            s, s_next = sigmas[i:i + 1], sigmas[i + 1:i + 2]
            x = sample_step("ode", x, model.velocity(x, s, cond, 4.0, uncond), s, s_next, 0.0).prev_sample
    torch.testing.assert_close(pack_2x2(x), expected, atol=1e-5, rtol=1e-5)


def test_condition_key_predicts_the_layout_and_groups_sizes(loaded, images):
    model = loaded["edit-plus"]
    plan = RolloutPlan(step_kinds=("ode",), train_steps=())

    def request(paths):
        return GenRequest(uid=0, prompt="p", prompt_index=0, group=0, seed=0, height=SIZE, width=SIZE, plan=plan,
                          inputs={"image": list(paths)})

    keys = {paths: model.condition_key(request(paths)) for paths in [(images[0],), (images[1],), images]}
    assert keys[(images[0],)] == ((4, 4),) and keys[(images[1],)] == ((4, 8),) and keys[images] == ((4, 4), (4, 8))
    for paths, key in keys.items():
        assert model.encode_with_images(["p"], [paths])[0].layout == key
    assert model.condition_key(request(())) is None and model.encode(["p"]).layout is None
    with pytest.raises(UsageError, match="one to three"):
        model.encode_with_images(["p"], [images * 2])


def test_a_checkpoint_of_another_pipeline_is_refused(tiny_dir, tmp_path: Path):
    t2i = Path(shutil.copytree(tiny_dir, tmp_path / "t2i"))  # the same components as a QwenImagePipeline
    index = json.loads((t2i / "model_index.json").read_text())
    del index["processor"]
    (t2i / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImagePipeline"}))
    with pytest.raises(UsageError, match="holds a QwenImagePipeline, not a Qwen-Image-Edit checkpoint"):
        load_pipeline(str(t2i), torch.float32)
    with pytest.raises(UsageError, match="no model_index.json"):
        load_pipeline(str(tmp_path / "nothing"), torch.float32)



def test_the_tiny_encoder_tells_sources_apart_at_the_noisy_tokens_scale(loaded, tmp_path: Path):
    """The tiny VAE's encoder is scaled so that sources encode to unit-scale condition tokens, like the unit Gaussian
    noisy tokens beside them (a random encoder's latents sit at an offset with a spread near 0.07: every source then
    looked alike to the transformer and the edit run could not learn to keep it). Sources: flat and two-colour
    pictures of the builtin edits' colours, other pictures than the ones the scale was measured on."""
    from omnirl_core.data.builtin.make_sets import square_pictures

    paths = square_pictures(tmp_path, SIZE)
    model = loaded["edit-plus"]
    latents = torch.cat([c.tensors["image_latents"] for c in model.encode_with_images(["p"] * len(paths),
                                                                                      [(p,) for p in paths])])
    channels = latents.view(len(paths), -1, model.latent_channels, 4).transpose(1, 2).flatten(2)  # (N, C, tokens*4)
    std = channels.std(dim=(0, 2))
    assert bool((std > 0.4).all() and (std < 2.5).all()), std
    assert float(channels.mean(dim=(0, 2)).abs().max()) < 0.8, channels.mean(dim=(0, 2))
    # sources differ by as much as the tokens vary: the spread across sources at each position is unit-scale too
    assert float(latents.std(dim=0).mean()) > 0.3
