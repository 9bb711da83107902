"""omnirl reward plugin: colour match between an image and the colour its prompt names."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="color",
            aliases=("colour",),
            description="1 - distance between the image's mean RGB and the colour named in the prompt "
            "(prompt-dependent; a tiny model learns it in minutes).",
            factory="omnirl_plugin_color.reward:ColorMatch",
            config="omnirl_plugin_color.reward:ColorOptions",
            modality=("image", "video"),  # a video scores the mean colour of all its frames
            default_prompts="omnirl_plugin_color.reward:DEFAULT_PROMPTS",
        )
    )
