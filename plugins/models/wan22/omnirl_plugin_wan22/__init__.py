"""omnirl model plugin: Wan2.2 text-to-video (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="wan2.2",
            aliases=("wan22", "wan"),
            description="Wan2.2 text-to-video via diffusers: A14B (two experts switched at a boundary sigma) "
            "or TI2V-5B (one transformer, 48-channel VAE), model.options.layout.",
            factory="omnirl_plugin_wan22.model:create_model",
            config="omnirl_plugin_wan22.model:Wan22Options",
            capabilities=frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "video"}),
            presets=("tiny",),
            default_path="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            recipe_defaults={
                "rollout": {"height": 480, "width": 832, "num_frames": 33, "num_steps": 16,
                            "guidance_scale": 4.0},
                "rewards": [{"name": "color"}],
            },
            preset_defaults={
                "tiny": {
                    "rollout": {"height": 16, "width": 16, "num_frames": 5, "num_steps": 6, "guidance_scale": 1.0,
                                "prompts_per_step": 4, "group_size": 8},
                    "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 40},
                    "model": {"lora": {"rank": 16, "alpha": 16}, "options": {"max_sequence_length": 16}},
                    "rewards": [{"name": "color"}],
                    "run": {"steps": 200, "save_every": 50, "sample_every": 20},
                }
            },
        )
    )
