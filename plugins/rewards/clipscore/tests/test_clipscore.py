"""CLIPScore: the plugin's scores equal the original recipe's (CLIPProcessor on the PIL image, CLIPModel's
get_image_features / get_text_features, w * max(cos, 0) in numpy) on a tiny random-weight CLIP; loading
errors; HF_HUB_OFFLINE; a tiny training run that raises the reward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_clipscore.reward import ClipScore, ClipScoreOptions
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import to_uint8
from omnirl_core.rewards_kit.tiny_clip import tiny_clip_directory
from omnirl_core.testing import check_reward_in_a_run, check_reward_rises, offline_error

PROMPTS = ["a red apple on a table", "a blue car", "a red apple on a table"]


@pytest.fixture(scope="module")
def tiny() -> ClipScore:
    return ClipScore(ClipScoreOptions(preset="tiny", device="cpu"))


@pytest.fixture(scope="module")
def tiny_raw() -> ClipScore:
    return ClipScore(ClipScoreOptions(preset="tiny", device="cpu", raw=True))


def _images(h: int, w: int, n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for _ in range(n)]


def reference_clipscore(model_dir: Path, outputs: list[torch.Tensor], captions: list[str], w: float = 2.5):
    """The CLIPScore recipe with transformers, on the same 8-bit images: returns (w * max(cos, 0), cos)."""
    processor = CLIPProcessor.from_pretrained(str(model_dir), use_fast=False)  # PIL, as the original scripts
    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    pil = [Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy()) for x in outputs]
    with torch.no_grad():
        image = model.get_image_features(**processor(images=pil, return_tensors="pt"))
        text = model.get_text_features(**processor(text=captions, padding=True, truncation=True, max_length=77,
                                                   return_tensors="pt"))
    image, text = (getattr(x, "pooler_output", x).double().numpy() for x in (image, text))
    image = image / np.linalg.norm(image, axis=1, keepdims=True)
    text = text / np.linalg.norm(text, axis=1, keepdims=True)
    cos = np.sum(image * text, axis=1)
    return w * np.clip(cos, 0, None), cos


@pytest.mark.parametrize("size", [(32, 32), (48, 40), (20, 50), (33, 31), (224, 300)])
def test_scores_equal_the_reference_recipe(tiny: ClipScore, tiny_raw: ClipScore, size: tuple[int, int]):
    """Native size (no resize), down- and upscaling, odd sizes: the tensor preprocessing reproduces
    CLIPProcessor's PIL resize and crop pixel for pixel, so the scores agree to float32 rounding."""
    outputs = _images(*size)
    directory = tiny_clip_directory("clipscore", "quick_gelu")
    expected, cos = reference_clipscore(directory, outputs, ["A photo depicts " + p for p in PROMPTS])
    assert np.abs(np.asarray(tiny(outputs, PROMPTS)) - expected).max() <= 1e-5
    assert np.abs(np.asarray(tiny_raw(outputs, PROMPTS)) - cos).max() <= 1e-5
    processor = CLIPProcessor.from_pretrained(str(directory), use_fast=False)
    pixels = processor(images=[Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy()) for x in outputs],
                       return_tensors="pt")["pixel_values"]
    assert (tiny.clip.preprocess(outputs) - pixels).abs().max().item() <= 1e-6


def test_w_and_clipping(tiny: ClipScore, tiny_raw: ClipScore):
    outputs = _images(32, 32, n=6, seed=1)
    prompts = [f"a photo of a {c} square" for c in ("red", "green", "blue", "black", "white", "gray")]
    cos = tiny_raw(outputs, prompts)
    assert all(-1 <= c <= 1 for c in cos)
    assert tiny(outputs, prompts) == pytest.approx([2.5 * max(c, 0.0) for c in cos], abs=1e-7)
    assert len(set(np.round(cos, 6))) == 6  # the scores depend on the image and the prompt


def test_reward_contract(tiny: ClipScore):
    from omnirl_core.testing import check_reward

    check_reward(tiny, _images(32, 32, n=2), ["a red square", "a blue sky"])


def test_tiny_preset_is_a_clip_checkpoint_on_disk():
    directory = tiny_clip_directory("clipscore", "quick_gelu")
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    model = CLIPModel.from_pretrained(str(directory))
    tokenizer = CLIPProcessor.from_pretrained(str(directory)).tokenizer
    assert model.config.vision_config.hidden_act == "quick_gelu"  # OpenAI CLIP's activation
    assert tokenizer.eos_token_id == len(tokenizer) - 1 == model.config.text_config.eos_token_id


def test_missing_files_are_named_with_where_to_put_them(tmp_path: Path):
    with pytest.raises(UsageError) as err:
        ClipScore(ClipScoreOptions(path=str(tmp_path), device="cpu"))
    text = err.value.render()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        assert name in err.value.message, text
    assert f"Put them in {tmp_path}" in text
    # a partial copy: only what is still missing is named
    directory = tiny_clip_directory("clipscore", "quick_gelu")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    with pytest.raises(UsageError, match=r"model\.safetensors missing for") as err:
        ClipScore(ClipScoreOptions(path=str(tmp_path), device="cpu"))
    assert "config.json" not in err.value.message


def test_hf_hub_offline_never_touches_the_network():
    """HF_HUB_OFFLINE=1 as users set it (in the environment, before Python starts): every socket is
    refused and recorded; the hub id is looked up in the local cache only and the error says so."""
    out = offline_error('from omnirl_plugin_clipscore.reward import ClipScore, ClipScoreOptions',
                        "ClipScore(ClipScoreOptions(path='omnirl-tests/no-such-clip', device='cpu'))")
    assert "config.json, model.safetensors" in out and "missing for 'omnirl-tests/no-such-clip'" in out
    assert "HF_HUB_OFFLINE=1 is set" in out
    assert "hf download omnirl-tests/no-such-clip --local-dir DIR" in out


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="extra"):
        ClipScoreOptions(wieght=2.0)


def test_entry_module_does_not_import_torch():
    code = "import sys, omnirl_plugin_clipscore; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_a_tiny_training_run_scores_with_the_reward(tmp_path: Path):
    check_reward_in_a_run(tmp_path / "run", "clipscore", "--set", "rewards.0.options.preset=tiny",
                          "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "clipscore", 60, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")
