"""omnirl model plugin: Qwen-Image (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec


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
            default_path="Qwen/Qwen-Image",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 10, "guidance_scale": 4.0},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={
                "tiny": {
                    "rollout": {"height": 32, "width": 32, "num_steps": 6, "guidance_scale": 1.0,
                                "prompts_per_step": 4, "group_size": 8},
                    "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 40},
                    "model": {"lora": {"rank": 16, "alpha": 16}},
                    "rewards": [{"name": "color"}],
                    "run": {"steps": 200, "save_every": 50, "sample_every": 20},
                }
            },
        )
    )
