"""omnirl reward plugin: LAION aesthetic predictor v2 (MLP on CLIP ViT-L/14 image embeddings)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="aesthetic",
            description="LAION aesthetic predictor v2: MLP on the normalised CLIP ViT-L/14 image embedding "
            "(1-10 rating, prompt-independent); head read from safetensors; tiny preset.",
            factory="omnirl_plugin_aesthetic.reward:AestheticScore",
            config="omnirl_plugin_aesthetic.reward:AestheticOptions",
            modality="image",
            default_prompts="omnirl_plugin_aesthetic.reward:DEFAULT_PROMPTS",
        )
    )
