"""omnirl reward plugin: PickScore (CLIP-H fine-tuned on Pick-a-Pic human preferences)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="pickscore",
            description="PickScore_v1: exp(logit_scale) * cos(image, prompt) of a CLIP-H fine-tuned on human "
            "preferences (transformers CLIPModel); tiny preset.",
            factory="omnirl_plugin_pickscore.reward:PickScore",
            config="omnirl_plugin_pickscore.reward:PickScoreOptions",
            modality="image",
            default_prompts="omnirl_plugin_pickscore.reward:DEFAULT_PROMPTS",
        )
    )
