"""omnirl reward plugin: Human Preference Score v2 / v2.1 (open_clip ViT-H-14 checkpoint, run via transformers)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="hpsv2",
            description="HPS v2/v2.1: cos(image, prompt) of a ViT-H-14 CLIP fine-tuned on human preferences "
            "(open_clip checkpoint converted to transformers); tiny preset.",
            factory="omnirl_plugin_hpsv2.reward:HPSv2",
            config="omnirl_plugin_hpsv2.reward:HPSv2Options",
            modality="image",
            default_prompts="omnirl_plugin_hpsv2.reward:DEFAULT_PROMPTS",
        )
    )
