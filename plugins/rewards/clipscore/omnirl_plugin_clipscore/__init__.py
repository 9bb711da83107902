"""omnirl reward plugin: CLIPScore (image-text agreement of any transformers CLIP checkpoint)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="clipscore",
            description="CLIPScore: 2.5 * max(cos(CLIP image, CLIP text), 0) (Hessel et al. 2021); any "
            "transformers CLIPModel; tiny preset.",
            factory="omnirl_plugin_clipscore.reward:ClipScore",
            config="omnirl_plugin_clipscore.reward:ClipScoreOptions",
            modality="image",
            default_prompts="omnirl_plugin_clipscore.reward:DEFAULT_PROMPTS",
        )
    )
