"""omnirl model plugin: Stable Diffusion 3.5 (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.presets import tiny_defaults
from omnirl_core.registry import ModelLimits, ModelSpec


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="sd3.5",
            aliases=("sd35", "sd3", "stable-diffusion-3.5"),
            description="Stable Diffusion 3.5 text-to-image via diffusers: Medium (MMDiT-X) or Large (MMDiT), "
            "two CLIP + optional T5 text encoders (model.options.layout, model.options.use_t5).",
            factory="omnirl_plugin_sd35.model:create_model",
            config="omnirl_plugin_sd35.model:SD35Options",
            capabilities=frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"}),
            presets=("tiny",),
            limits={"tiny": ModelLimits(size_multiple=8), None: ModelLimits(size_multiple=16)},
            default_path="stabilityai/stable-diffusion-3.5-medium",
            sizing="omnirl_plugin_sd35.sizing:sizing",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 10, "guidance_scale": 4.5},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={"tiny": tiny_defaults(model={"options": {"max_sequence_length": 16}})},
        )
    )
