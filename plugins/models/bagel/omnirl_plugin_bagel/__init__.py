"""omnirl model plugin: BAGEL (BAGEL-7B-MoT), a native implementation. Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec


@hookimpl
def omnirl_register_models(register):
    register(
        ModelSpec(
            name="bagel",
            aliases=("bagel-7b-mot",),
            description="BAGEL-7B-MoT text-to-image: Qwen2.5 Mixture-of-Transformers (understanding + generation "
            "experts) with a FLUX autoencoder, native PyTorch.",
            factory="omnirl_plugin_bagel.model:create_model",
            config="omnirl_plugin_bagel.model:BagelOptions",
            capabilities=frozenset({"flow-matching", "sde-logprob", "cfg", "lora", "image"}),
            presets=("tiny",),
            default_path="ByteDance-Seed/BAGEL-7B-MoT",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 15, "guidance_scale": 4.0,
                            "negative_prompt": ""},
                "model": {"dtype": "bfloat16", "lora": {"rank": 64, "alpha": 128}},
                "rewards": [{"name": "jpeg"}],
            },
            preset_defaults={
                "tiny": {
                    "model": {"dtype": "float32", "lora": {"rank": 16, "alpha": 16}},
                    "rollout": {"height": 32, "width": 32, "num_steps": 6, "guidance_scale": 1.0,
                                "prompts_per_step": 4, "group_size": 8},
                    "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 40},
                    "rewards": [{"name": "color"}],
                    "run": {"steps": 200, "save_every": 50, "sample_every": 20},
                }
            },
        )
    )
