"""omnirl model plugin: BAGEL (BAGEL-7B-MoT), a native implementation. Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.presets import tiny_defaults
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
            sizing="omnirl_plugin_bagel.sizing:sizing",
            recipe_defaults={
                "rollout": {"height": 512, "width": 512, "num_steps": 15, "guidance_scale": 4.0,
                            "negative_prompt": ""},
                "model": {"dtype": "bfloat16", "lora": {"rank": 64, "alpha": 128}},
                "rewards": [{"name": "jpeg"}],
            },
            # the first-party tiny values (32x32, 6 steps, 4 prompts x 8, LoRA r16 at lr 1e-2, colour reward), with
            # the colour scored on the central half of the image and one colour prompt: the tiny FLUX autoencoder's
            # GroupNorm(32) over 32 channels normalises every channel per image, so the whole image's mean colour
            # hardly moves with the latent (std 0.005 over samples) while the centre's does (0.07); and the random
            # network reads its prompt too weakly for 40 steps to learn one colour per prompt (README, "Figures")
            preset_defaults={"tiny": tiny_defaults(
                model={"dtype": "float32"},
                rewards=[{"name": "color", "options": {"region": 0.5}}],
                data={"prompts": ["a red square"]},
            )},
        )
    )
