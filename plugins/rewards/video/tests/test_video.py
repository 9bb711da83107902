"""Video rewards: video-frames wraps an image reward found in the plugin registry (frames picked by stride
and max_frames, one batched call, mean / min, records forwarded, non-image rewards refused);
temporal-consistency equals the formula written out here on the CLIP embeddings of the frames."""

from __future__ import annotations

import types
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from omnirl_plugin_video.frames import VideoFrames, VideoFramesOptions, frame_indices, input_fields
from omnirl_plugin_video.temporal import TemporalConsistency, TemporalOptions
from pydantic import BaseModel, ConfigDict
from transformers import CLIPModel

from omnirl_core import hookimpl
from omnirl_core.contracts import Reward
from omnirl_core.errors import UsageError
from omnirl_core.plugins import PluginManager, set_plugin_manager
from omnirl_core.registry import RewardSpec
from omnirl_core.rewards_kit.clip import ClipPreprocessor
from omnirl_core.rewards_kit.tiny_clip import tiny_clip_directory


class LevelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = 1.0


class Level(Reward):
    """Mean level of an image times scale, plus the record's bonus; remembers its batch sizes."""

    uses_inputs = True
    calls: ClassVar[list[int]] = []

    def __init__(self, options: LevelOptions):
        self.scale = options.scale

    def __call__(self, outputs, prompts, inputs):
        Level.calls.append(len(outputs))
        return [self.scale * float(o.mean()) + (x or {}).get("bonus", 0) for o, x in zip(outputs, inputs)]


@pytest.fixture
def registry():
    hooks = types.SimpleNamespace()

    @hookimpl
    def omnirl_register_rewards(register):
        register(RewardSpec(name="level", factory=Level, config=LevelOptions, modality="image",
                            input_fields=("bonus",)))
        register(RewardSpec(name="words", factory=lambda options: None, modality="text"))

    hooks.omnirl_register_rewards = omnirl_register_rewards
    manager = PluginManager()
    manager.register(hooks, "test-rewards")
    set_plugin_manager(manager)
    yield manager
    set_plugin_manager(None)


def _video(frames: int, levels: list[float]) -> torch.Tensor:
    return torch.stack([torch.full((3, 4, 4), lv) for lv in levels], dim=1) if levels else torch.zeros(3, frames, 4, 4)


def test_frame_indices():
    assert frame_indices(9, 1, None) == list(range(9))
    assert frame_indices(9, 2, None) == [0, 2, 4, 6, 8]
    assert frame_indices(9, 2, 3) == [0, 4, 8]
    assert frame_indices(9, 1, 1) == [0]
    assert frame_indices(5, 3, 10) == [0, 3]


def test_video_frames_mean_min_stride_and_records(registry):
    videos = [_video(5, [0.1, 0.2, 0.3, 0.4, 0.5]), _video(5, [0.9, 0.1, 0.9, 0.1, 0.9])]
    Level.calls.clear()
    mean = VideoFrames(VideoFramesOptions(reward="level", options={"scale": 2.0}))
    assert mean.uses_inputs
    got = mean(videos, ["a", "b"], inputs=[{"bonus": 10}, {"bonus": 0}])
    assert got == pytest.approx([10 + 2 * 0.3, 2 * 0.58])
    assert Level.calls == [10]  # every frame of both videos in one call
    worst = VideoFrames(VideoFramesOptions(reward="level", reduce="min", stride=2))
    assert worst(videos, ["a", "b"], inputs=[None, None]) == pytest.approx([0.1, 0.9])  # frames 0, 2, 4
    assert input_fields(VideoFramesOptions(reward="level")) == ("bonus",)
    with pytest.raises(ValueError, match=r"expected a video \(3, F, H, W\)"):
        mean([torch.zeros(3, 4, 4)], ["a"], inputs=[None])


def test_video_frames_refuses_a_reward_that_does_not_score_images(registry):
    with pytest.raises(UsageError, match="reward 'words' scores text, not images"):
        VideoFrames(VideoFramesOptions(reward="words"))
    with pytest.raises(UsageError) as err:
        VideoFrames(VideoFramesOptions(reward="level", options={"scael": 2.0}))
    assert "Invalid options for reward 'level'" in err.value.render() and "scael" in err.value.render()


def test_temporal_consistency_equals_the_formula_on_clip_embeddings():
    reward = TemporalConsistency(TemporalOptions(preset="tiny", device="cpu", stride=2, anchor_weight=0.5))
    g = torch.Generator().manual_seed(0)
    moving = torch.rand(3, 7, 24, 24, generator=g)
    still = torch.rand(3, 1, 24, 24, generator=g).expand(3, 5, 24, 24)
    got = reward([moving, still], ["a", "b"])

    directory = tiny_clip_directory("temporal-consistency", "quick_gelu")
    model = CLIPModel.from_pretrained(str(directory)).eval()
    from transformers import CLIPImageProcessor

    pre = ClipPreprocessor.from_image_processor(CLIPImageProcessor.from_pretrained(str(directory)))
    frames = [moving[:, t] for t in (0, 2, 4, 6)]
    with torch.no_grad():
        e = model.get_image_features(pixel_values=pre(frames))
    e = F.normalize(getattr(e, "pooler_output", e), dim=-1)
    expected = sum(0.5 * float(e[t] @ e[t - 1]) + 0.5 * float(e[t] @ e[0]) for t in (1, 2, 3)) / 3
    assert got[0] == pytest.approx(expected, abs=1e-6)
    assert got[1] == pytest.approx(1.0, abs=1e-6) and got[0] < got[1]

