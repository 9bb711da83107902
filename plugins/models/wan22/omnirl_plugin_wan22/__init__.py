"""omnirl model plugin: Wan2.2 text-to-video (diffusers). Importing this module is cheap: no torch."""

from omnirl_core.registry import ModelLimits


def limits(section, options) -> ModelLimits:
    """Sizes: VAE downsampling x patch 2 (a14b: 8 x 2, ti2v-5b: 16 x 2); frames: 4k+1. The tiny VAEs downsample
    one level fewer in space and time (x 1/2, 2k+1 frames)."""
    multiple = {"a14b": 16, "ti2v-5b": 32}[options.layout if options is not None else "a14b"]
    if section.preset == "tiny":
        return ModelLimits(size_multiple=multiple // 2, frame_multiple=2)
    return ModelLimits(size_multiple=multiple, frame_multiple=4)
