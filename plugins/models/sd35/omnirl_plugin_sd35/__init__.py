"""omnirl model plugin: Stable Diffusion 3.5 (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec


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
            default_path="stabilityai/stable-diffusion-3.5-medium",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 10, "guidance_scale": 4.5},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={
                "tiny": {
                    "rollout": {"height": 32, "width": 32, "num_steps": 6, "guidance_scale": 1.0,
                                "prompts_per_step": 4, "group_size": 8},
                    "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 40},
                    "model": {"lora": {"rank": 16, "alpha": 16}, "options": {"max_sequence_length": 16}},
                    "rewards": [{"name": "color"}],
                    "run": {"steps": 200, "save_every": 50, "sample_every": 20},
                }
            },
        )
    )
