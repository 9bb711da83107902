"""omnirl reward plugin: ImageReward (BLIP ViT-L + BERT cross-attention + MLP head)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="imagereward",
            description="ImageReward (Xu et al. 2023): human-preference score from BLIP's image-grounded text "
            "encoder and an MLP head, on transformers' BLIP (release converted once to safetensors); tiny preset.",
            factory="omnirl_plugin_imagereward.reward:ImageRewardScore",
            config="omnirl_plugin_imagereward.reward:ImageRewardOptions",
            modality="image",
            default_prompts="omnirl_plugin_imagereward.reward:DEFAULT_PROMPTS",
        )
    )
