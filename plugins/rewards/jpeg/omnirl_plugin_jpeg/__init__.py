"""omnirl reward plugin: JPEG compressibility (DDPO / FlowGRPO): reward = -(JPEG size in kB)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="jpeg",
            aliases=("jpeg-compressibility",),
            description="Negative JPEG file size in kB at a fixed quality (compressible images score higher).",
            factory="omnirl_plugin_jpeg.reward:JpegCompressibility",
            config="omnirl_plugin_jpeg.reward:JpegOptions",
            modality="image",
            default_prompts="omnirl_plugin_jpeg.reward:DEFAULT_PROMPTS",
        )
    )
