"""omnirl model plugin: Wan2.2 text-to-video (diffusers). Importing this module is cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.presets import tiny_defaults
from omnirl_core.registry import ModelLimits, ModelSpec


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
            limits="omnirl_plugin_wan22:limits",
            default_path="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            sizing="omnirl_plugin_wan22.sizing:sizing",
            recipe_defaults={
                "rollout": {"height": 480, "width": 832, "num_frames": 33, "num_steps": 16,
                            "guidance_scale": 4.0},
                "rewards": [{"name": "color"}],
            },
            preset_defaults={"tiny": tiny_defaults(
                rollout={"height": 16, "width": 16, "num_frames": 5}, model={"options": {"max_sequence_length": 16}},
            )},
        )
    )


def limits(section, options) -> ModelLimits:
    """Sizes: VAE downsampling x patch 2 (a14b: 8 x 2, ti2v-5b: 16 x 2); frames: 4k+1. The tiny VAEs downsample
    one level fewer in space and time (x 1/2, 2k+1 frames)."""
    multiple = {"a14b": 16, "ti2v-5b": 32}[options.layout if options is not None else "a14b"]
    if section.preset == "tiny":
        return ModelLimits(size_multiple=multiple // 2, frame_multiple=2)
    return ModelLimits(size_multiple=multiple, frame_multiple=4)
