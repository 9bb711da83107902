"""omnirl reward plugin: video rewards (an image reward per frame; temporal consistency)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="video-frames",
            description="Any installed image reward on the frames of a video (every stride-th frame), reduced "
            "by mean or min.",
            factory="omnirl_plugin_video.frames:VideoFrames",
            config="omnirl_plugin_video.frames:VideoFramesOptions",
            modality="video",
            input_fields="omnirl_plugin_video.frames:input_fields",
            default_prompts="omnirl_plugin_video.frames:DEFAULT_PROMPTS",
        )
    )
    register(
        RewardSpec(
            name="temporal-consistency",
            description="Mean cosine similarity of the CLIP image embeddings of consecutive frames (1: no change "
            "between frames); any transformers CLIPModel; tiny preset.",
            factory="omnirl_plugin_video.temporal:TemporalConsistency",
            config="omnirl_plugin_video.temporal:TemporalOptions",
            modality="video",
            default_prompts="omnirl_plugin_video.temporal:DEFAULT_PROMPTS",
        )
    )
