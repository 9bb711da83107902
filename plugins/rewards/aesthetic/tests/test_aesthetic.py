"""Aesthetic predictor: no package ships it (the release is a script + a .pth), so the reference is the
released recipe written out here: CLIP image features of the PIL image (CLIPProcessor + get_image_features),
L2-normalised in numpy as the script's ``normalized``, into the published MLP layout built in this file.
Plus the one-time .pth -> safetensors conversion, loading errors, HF_HUB_OFFLINE and a training run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_aesthetic.convert import convert
from omnirl_plugin_aesthetic.reward import MLP_FILE, AestheticOptions, AestheticScore, tiny_directory
from PIL import Image
from safetensors.torch import load_file
from torch import nn
from transformers import CLIPModel, CLIPProcessor

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import to_uint8
from omnirl_core.testing import check_reward_in_a_run, check_reward_rises, offline_error


def published_mlp(input_size: int) -> nn.Module:
    """simple_inference.py's MLP.layers (christophschuhmann/improved-aesthetic-predictor)."""
    layers = nn.Sequential(
        nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
    )
    holder = nn.Module()
    holder.layers = layers
    return holder


def normalized(a: np.ndarray, axis: int = -1, order: int = 2) -> np.ndarray:
    l2 = np.atleast_1d(np.linalg.norm(a, order, axis))
    l2[l2 == 0] = 1
    return a / np.expand_dims(l2, axis)


def reference_scores(clip_dir: Path, mlp: nn.Module, outputs: list[torch.Tensor]) -> np.ndarray:
    processor = CLIPProcessor.from_pretrained(str(clip_dir), use_fast=False)  # the PIL pipeline, as `clip`
    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    pil = [Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy()) for x in outputs]
    with torch.no_grad():
        features = model.get_image_features(**processor(images=pil, return_tensors="pt"))
        features = getattr(features, "pooler_output", features)
        emb = normalized(features.numpy())
        return mlp.eval().layers(torch.from_numpy(emb).float()).squeeze(-1).numpy()


def _images(h: int, w: int, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path]:
    """A random head in the published layout, saved as the release is (a .pth state dict), converted."""
    directory = tmp_path_factory.mktemp("head")
    torch.manual_seed(3)
    mlp = published_mlp(16)
    torch.save(mlp.state_dict(), directory / "head.pth")
    return mlp, convert(directory / "head.pth", directory / "head.safetensors")


@pytest.mark.parametrize("size", [(32, 32), (50, 40)])
def test_scores_equal_the_released_recipe(converted: tuple[nn.Module, Path], size: tuple[int, int]):
    mlp, head = converted
    clip_dir = tiny_directory()
    reward = AestheticScore(AestheticOptions(clip_path=str(clip_dir), mlp_path=str(head), device="cpu"))
    outputs = _images(*size)
    got = np.asarray(reward(outputs, ["ignored"] * len(outputs)))
    expected = reference_scores(clip_dir, mlp, outputs)
    assert np.abs(got - expected).max() <= 1e-5, (got, expected)
    assert len(set(np.round(got, 6))) == len(outputs)


def test_conversion_keeps_the_tensors_and_refuses_other_layouts(converted: tuple[nn.Module, Path],
                                                                 tmp_path: Path):
    mlp, head = converted
    saved = load_file(str(head))
    assert set(saved) == set(mlp.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in mlp.state_dict().items())
    torch.save({"layers.0.weight": torch.zeros(4, 4)}, tmp_path / "other.pth")
    with pytest.raises(UsageError, match="not an aesthetic predictor head"):
        convert(tmp_path / "other.pth", tmp_path / "other.safetensors")
    assert not (tmp_path / "other.safetensors").exists()


def test_tiny_preset_and_contract():
    reward = AestheticScore(AestheticOptions(preset="tiny", device="cpu"))
    directory = tiny_directory()
    assert (directory / MLP_FILE).is_file() and (directory / "model.safetensors").is_file()
    assert CLIPModel.from_pretrained(str(directory)).config.vision_config.hidden_act == "quick_gelu"
    from omnirl_core.testing import check_reward

    scores = check_reward(reward, _images(32, 32, n=3), ["a", "b", "c"])
    assert reward(_images(32, 32, n=3), ["x", "y", "z"]) == scores  # the prompt plays no part


def test_missing_head_and_pickles_are_refused_with_the_conversion_command(tmp_path: Path):
    with pytest.raises(UsageError) as err:
        AestheticScore(AestheticOptions(device="cpu"))
    assert "mlp_path is not set" in err.value.message
    assert "python -m omnirl_plugin_aesthetic.convert" in err.value.render()
    torch.save(published_mlp(16).state_dict(), tmp_path / "head.pth")
    with pytest.raises(UsageError, match="not a .safetensors file") as err:
        AestheticScore(AestheticOptions(mlp_path=str(tmp_path / "head.pth"), device="cpu"))
    assert "python -m omnirl_plugin_aesthetic.convert" in err.value.render()


def test_missing_clip_files(tmp_path: Path, converted: tuple[nn.Module, Path]):
    with pytest.raises(UsageError) as err:
        AestheticScore(AestheticOptions(clip_path=str(tmp_path), mlp_path=str(converted[1]), device="cpu"))
    assert "config.json, model.safetensors, preprocessor_config.json" in err.value.message
    assert f"Put them in {tmp_path}" in err.value.render() and "clip_path" in err.value.render()


def test_hf_hub_offline_never_touches_the_network(converted: tuple[nn.Module, Path]):
    out = offline_error('from omnirl_plugin_aesthetic.reward import AestheticOptions, AestheticScore',
                        f"AestheticScore(AestheticOptions(mlp_path={str(converted[1])!r}, device='cpu'))")
    assert "missing for 'openai/clip-vit-large-patch14'" in out and "HF_HUB_OFFLINE=1 is set" in out


@pytest.mark.slow
def test_a_tiny_training_run_scores_with_the_reward(tmp_path: Path):
    check_reward_in_a_run(tmp_path / "run", "aesthetic", "--set", "rewards.0.options.preset=tiny",
                          "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "aesthetic", 60, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_multi_reward_run_raises_the_summed_reward(tmp_path: Path):
    """Two learned rewards, the second with its own advantage (rewards.1.advantage=own)."""
    check_reward_rises(tmp_path / "run", "aesthetic", 50, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", "--reward", "clipscore:0.5",
                       "--set", "rewards.1.options.preset=tiny", "--set", "rewards.1.options.device=cpu",
                       "--set", "rewards.1.advantage=own", model="qwen-image", algo="flowgrpo")
