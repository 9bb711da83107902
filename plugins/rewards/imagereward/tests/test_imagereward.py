"""ImageReward: the plugin (transformers' BLIP, converted checkpoint) scores like the release's code on a tiny
random checkpoint of the release's layout: live against the `image-reward` package's med.py text encoder when
IMAGEREWARD_PYTHON names a Python that has it (it cannot be installed next to omnirl), and in every run against
the scores that reference produced (reference_scores.json, regenerated with the command in its header);
conversion and errors; a tiny run whose reward rises."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_imagereward.convert import convert_state
from omnirl_plugin_imagereward.reward import ImageRewardOptions, ImageRewardScore
from omnirl_plugin_imagereward.tiny import tiny_directory

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import to_uint8
from omnirl_core.testing import check_reward_in_a_run, check_reward_rises

HERE = Path(__file__).parent
SIZES = [(32, 32), (48, 40), (24, 50), (33, 31)]
PROMPTS = ["a cat on a sofa", "a red car", "a bowl of fruit on a wooden table, photo", "!"]


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.rand(3, h, w, generator=g) for h, w in SIZES]


@pytest.fixture(scope="module")
def tiny() -> ImageRewardScore:
    return ImageRewardScore(ImageRewardOptions(preset="tiny", device="cpu"))


def test_scores_equal_the_stored_reference(tiny: ImageRewardScore):
    expected = json.loads((HERE / "reference_scores.json").read_text())["scores"]
    got = tiny(_images(), PROMPTS)
    assert np.abs(np.array(got) - np.array(expected)).max() <= 1e-5, (got, expected)
    assert len(set(np.round(got, 5))) == 4


@pytest.mark.skipif(not os.environ.get("IMAGEREWARD_PYTHON"), reason="IMAGEREWARD_PYTHON (a Python with the "
                    "image-reward package) is not set")
def test_scores_equal_the_release_code(tiny: ImageRewardScore, tmp_path: Path):
    arrays = {f"image{i}": to_uint8(x).permute(1, 2, 0).numpy() for i, x in enumerate(_images())}
    np.savez(tmp_path / "images.npz", prompts=json.dumps(PROMPTS), **arrays)
    subprocess.run([os.environ["IMAGEREWARD_PYTHON"], str(HERE / "imagereward_reference.py"), str(tiny_directory()),
                    str(tmp_path / "images.npz"), str(tmp_path / "out.json")], check=True, timeout=600)
    reference = json.loads((tmp_path / "out.json").read_text())
    got = tiny(_images(), PROMPTS)
    assert np.abs(np.array(got) - np.array(reference["scores"])).max() <= 1e-5, (got, reference)
    print("max |plugin - release|:", np.abs(np.array(got) - np.array(reference["scores"])).max(), reference)


def test_conversion_refuses_other_checkpoints_and_loading_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        convert_state({"visual.proj": torch.zeros(2)})
    with pytest.raises(UsageError) as err:
        ImageRewardScore(ImageRewardOptions(device="cpu"))
    assert "rewards.<i>.options.path is not set" in err.value.message
    (tmp_path / "ir").mkdir()
    with pytest.raises(UsageError) as err:
        ImageRewardScore(ImageRewardOptions(path=str(tmp_path / "ir"), device="cpu"))
    text = err.value.render()
    assert "model.safetensors, imagereward_config.json, tokenizer.json missing in" in text
    assert "python -m omnirl_plugin_imagereward.convert" in text


@pytest.mark.slow
def test_a_tiny_training_run_scores_with_the_reward(tmp_path: Path):
    check_reward_in_a_run(tmp_path / "run", "imagereward", "--set", "rewards.0.options.preset=tiny",
                          "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "imagereward", 50, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")
