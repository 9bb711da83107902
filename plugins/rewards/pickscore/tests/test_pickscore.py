"""PickScore: the plugin's scores equal the authors' inference recipe (CLIPProcessor on PIL images,
get_image_features / get_text_features, logit_scale.exp() * text @ image.T) on a tiny random-weight CLIP-H
layout; loading errors; HF_HUB_OFFLINE; a tiny training run that raises the reward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_pickscore.reward import PickScore, PickScoreOptions
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import to_uint8
from omnirl_core.rewards_kit.tiny_clip import tiny_clip_directory
from omnirl_core.testing import check_reward_in_a_run, check_reward_rises, offline_error


@pytest.fixture(scope="module")
def tiny() -> PickScore:
    return PickScore(PickScoreOptions(preset="tiny", device="cpu"))


def _images(h: int, w: int, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for _ in range(n)]


def reference_pickscore(model_dir: Path, outputs: list[torch.Tensor], prompt: str) -> np.ndarray:
    """PickScore's published inference function, verbatim in substance, on the same 8-bit images."""
    processor = CLIPProcessor.from_pretrained(str(model_dir), use_fast=False)  # the authors' (PIL) processor
    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    images = [Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy()) for x in outputs]
    image_inputs = processor(images=images, padding=True, truncation=True, max_length=77, return_tensors="pt")
    text_inputs = processor(text=prompt, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_embs = getattr(e := model.get_image_features(**image_inputs), "pooler_output", e)
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = getattr(e := model.get_text_features(**text_inputs), "pooler_output", e)
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)[0]
    return scores.numpy()


@pytest.mark.parametrize("size", [(32, 32), (64, 48), (24, 40)])
def test_scores_equal_the_authors_recipe(tiny: PickScore, size: tuple[int, int]):
    outputs = _images(*size)
    directory = tiny_clip_directory("pickscore", "gelu")
    prompts = ["a fox in the snow"] * 2 + ["a cabin by a lake"] * 2
    expected = np.concatenate([reference_pickscore(directory, outputs[:2], prompts[0]),
                               reference_pickscore(directory, outputs[2:], prompts[2])])
    got = np.asarray(tiny(outputs, prompts))
    assert np.abs(got - expected).max() <= 1e-5, (got, expected)
    assert len(set(np.round(got, 5))) == 4


def test_tiny_preset_has_the_clip_h_activation_and_a_logit_scale(tiny: PickScore):
    model = CLIPModel.from_pretrained(str(tiny_clip_directory("pickscore", "gelu")))
    assert model.config.vision_config.hidden_act == model.config.text_config.hidden_act == "gelu"
    assert tiny.scale == pytest.approx(float(model.logit_scale.detach().exp()))
    from omnirl_core.testing import check_reward

    check_reward(tiny, _images(32, 32, n=2), ["a red square", "a blue sky"])


def test_missing_model_and_processor_files(tmp_path: Path):
    model_dir, processor_dir = tmp_path / "model", tmp_path / "processor"
    model_dir.mkdir()
    processor_dir.mkdir()
    with pytest.raises(UsageError) as err:
        PickScore(PickScoreOptions(path=str(model_dir), processor_path=str(processor_dir), device="cpu"))
    assert err.value.message.startswith("PickScore: config.json, model.safetensors missing for")
    assert f"Put them in {model_dir}" in err.value.render()
    source = tiny_clip_directory("pickscore", "gelu")
    for name in ("config.json", "model.safetensors"):
        (model_dir / name).write_bytes((source / name).read_bytes())
    with pytest.raises(UsageError) as err:
        PickScore(PickScoreOptions(path=str(model_dir), processor_path=str(processor_dir), device="cpu"))
    assert "preprocessor_config.json, tokenizer.json" in err.value.message
    assert "processor_path" in err.value.render()
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (processor_dir / name).write_bytes((source / name).read_bytes())
    loaded = PickScore(PickScoreOptions(path=str(model_dir), processor_path=str(processor_dir), device="cpu"))
    outputs = _images(32, 32, n=2)
    tiny = PickScore(PickScoreOptions(preset="tiny", device="cpu"))
    assert loaded(outputs, ["a", "b"]) == tiny(outputs, ["a", "b"])


def test_hf_hub_offline_never_touches_the_network():
    out = offline_error('from omnirl_plugin_pickscore.reward import PickScore, PickScoreOptions',
                        "PickScore(PickScoreOptions(device='cpu'))")
    assert "missing for 'yuvalkirstain/PickScore_v1'" in out and "HF_HUB_OFFLINE=1 is set" in out
    assert "hf download yuvalkirstain/PickScore_v1 --local-dir DIR" in out


@pytest.mark.slow
def test_a_tiny_training_run_scores_with_the_reward(tmp_path: Path):
    check_reward_in_a_run(tmp_path / "run", "pickscore", "--set", "rewards.0.options.preset=tiny",
                          "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "pickscore", 100, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")
