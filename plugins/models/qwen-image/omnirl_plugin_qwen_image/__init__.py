"""omnirl model plugin: Qwen-Image (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.presets import tiny_defaults
from omnirl_core.registry import ModelLimits, ModelSpec


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="qwen-image",
            aliases=("qwen_image", "qwenimage"),
            description="Qwen-Image text-to-image (MMDiT, Qwen2.5-VL text encoder) via diffusers.",
            factory="omnirl_plugin_qwen_image.model:create_model",
            config="omnirl_plugin_qwen_image.model:QwenImageOptions",
            capabilities=frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"}),
            presets=("tiny",),
            limits={"tiny": ModelLimits(size_multiple=8), None: ModelLimits(size_multiple=16)},
            default_path="Qwen/Qwen-Image",
            sizing="omnirl_plugin_qwen_image.sizing:sizing",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 10, "guidance_scale": 4.0},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={"tiny": tiny_defaults()},
        )
    )
