"""``video-frames``: an image reward applied to the frames of each video, reduced to one score per video.

score(video) = reduce_{t in {0, s, 2s, ...}} r(frame_t, prompt), reduce = mean or min, s = the frame stride;
the frames of every video of a call go to the image reward in one batch. The image reward is any installed
reward that scores images (``reward``, with its own ``options``), built through the plugin registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward, as_reward
from omnirl_core.errors import UsageError

DEFAULT_PROMPTS = [
    "a red car driving along a coastal road",
    "a cat walking across a sunny garden",
    "waves rolling onto a sandy beach at sunset",
    "a hot air balloon rising over green hills",
    "a person riding a bicycle through a city street",
    "leaves falling from a tree in autumn",
]


class VideoFramesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: str = Field("clipscore", description="The image reward applied to each frame (any installed reward "
                        "that scores images, e.g. clipscore, pickscore, hpsv2, aesthetic, imagereward).")
    options: dict[str, Any] = Field(default_factory=dict, description="That reward's options (e.g. "
                                    "{preset: tiny} or {path: DIR, device: cuda}).")
    reduce: Literal["mean", "min"] = Field("mean", description="How the frames' scores make the video's: mean, or "
                                           "min (the worst frame).")
    stride: int = Field(1, ge=1, description="Score every stride-th frame (0, s, 2s, ...).")
    max_frames: int | None = Field(None, ge=1, description="Score at most this many frames per video, spread "
                                   "evenly over the strided ones; None: all.")


def _inner_spec(name: str) -> Any:
    from omnirl_core.plugins import get_plugin_manager

    return get_plugin_manager().resolve("reward", name)


def input_fields(options: VideoFramesOptions | None) -> Any:
    """The prompt-record fields the wrapped image reward reads."""
    from omnirl_core.config import validate_options
    from omnirl_core.registry import load_object

    options = options or VideoFramesOptions()
    spec = _inner_spec(options.reward)
    fields = spec.input_fields
    if isinstance(fields, str):
        fields = load_object(fields)(validate_options(dict(options.options), spec.load_config(), "options"))
    return fields


def frame_indices(count: int, stride: int, max_frames: int | None) -> list[int]:
    """0, s, 2s, ... below ``count``; with ``max_frames``, that many of them spread evenly (first and last kept)."""
    picked = list(range(0, count, stride))
    if max_frames is not None and len(picked) > max_frames:
        if max_frames == 1:
            return picked[:1]
        step = (len(picked) - 1) / (max_frames - 1)
        picked = [picked[round(i * step)] for i in range(max_frames)]
    return picked


class VideoFrames(Reward):
    def __init__(self, options: VideoFramesOptions | None = None):
        from omnirl_core.rewards_kit import build_reward

        self.options = o = options or VideoFramesOptions()
        reward, spec = build_reward(o.reward, o.options)
        if "image" not in spec.modalities and "any" not in spec.modalities:
            raise UsageError(f"video-frames: reward '{o.reward}' scores {' or '.join(spec.modalities)}, not images.",
                             hint="Pick an image reward for rewards.<i>.options.reward (see `omnirl rewards`).")
        self.reward = as_reward(reward)
        self.uses_inputs = self.reward.uses_inputs

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],
                 inputs: Sequence[Any] | None = None) -> list[float]:
        frames, frame_prompts, frame_inputs, owners = [], [], [], []
        for i, (video, prompt) in enumerate(zip(outputs, prompts)):
            if getattr(video, "dim", lambda: 0)() != 4 or video.shape[0] != 3:
                raise ValueError(f"video-frames: expected a video (3, F, H, W), got shape "
                                 f"{tuple(getattr(video, 'shape', ()))}")
            for t in frame_indices(video.shape[1], self.options.stride, self.options.max_frames):
                frames.append(video[:, t])
                frame_prompts.append(prompt)
                frame_inputs.append(inputs[i] if inputs is not None else None)
                owners.append(i)
        if self.uses_inputs:
            scores = self.reward(frames, frame_prompts, inputs=frame_inputs)
        else:
            scores = self.reward(frames, frame_prompts)
        scores = [float(s) for s in scores]
        if len(scores) != len(frames):
            raise ValueError(f"video-frames: '{self.options.reward}' returned {len(scores)} scores for "
                             f"{len(frames)} frames")
        per_video: list[list[float]] = [[] for _ in outputs]
        for owner, score in zip(owners, scores):
            per_video[owner].append(score)
        reduce = min if self.options.reduce == "min" else (lambda xs: sum(xs) / len(xs))
        return [reduce(xs) for xs in per_video]
