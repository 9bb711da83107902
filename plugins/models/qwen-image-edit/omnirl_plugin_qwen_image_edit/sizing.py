"""Qwen-Image-Edit for the memory planner (``omnirl plan``): on ``meta`` at the configured resolution, with one
condition image at ``vae_image_area`` pixels (its tokens join the noisy ones in every transformer call) and the
prompt's vision tokens; the released architecture, or the tiny preset's when the run uses it."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from omnirl_core.planning import model as plan
from omnirl_core.planning.activations import DenoiserProbe
from omnirl_plugin_qwen_image_edit import tiny
from omnirl_plugin_qwen_image_edit.full_size import TRANSFORMER, VAE, full_size_components

VAE_SCALE = 8
PATCH = 2
TEXT_TOKENS = 512
"""The instruction's tokens the plan allows for (beside each condition image's vision tokens)."""
VL_FACTOR = 28
"""The vision tower's patch (14) x merge (2): one prompt token per 28 x 28 pixels of a condition image."""


@functools.lru_cache(maxsize=1)
def _components() -> dict[str, torch.nn.Module]:
    return full_size_components()  # meta: no memory to keep


@functools.lru_cache(maxsize=1)
def _tiny_components() -> dict[str, torch.nn.Module]:
    """The tiny preset's modules on meta (the special tokens' ids as the Qwen2 tokenizer numbers them)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omnirl_core.presets import QWEN2_SPECIALS, QWEN2_VOCAB_SIZE

    ids = {name: 151643 + i for i, name in enumerate(QWEN2_SPECIALS)}
    config = Qwen2_5_VLConfig(**tiny.text_encoder_config(ids, QWEN2_VOCAB_SIZE))
    with torch.device("meta"):
        return {"transformer": QwenImageTransformer2DModel(**tiny.TRANSFORMER),
                "vae": AutoencoderKLQwenImage(**tiny.VAE),
                "text_encoder": Qwen2_5_VLForConditionalGeneration(config)}


def _architecture(config: Any) -> tuple[str, dict[str, Any], dict[str, Any], int]:
    """(label, transformer config, VAE config, VAE scale) of the checkpoint the run loads."""
    if config.model.preset == "tiny":
        return f"qwen-image-edit-tiny-v{tiny.TINY_VERSION}", tiny.TRANSFORMER, tiny.VAE, tiny.VAE_SCALE
    return "qwen-image-edit", TRANSFORMER, VAE, VAE_SCALE


def condition_tokens(options: Any, scale: int) -> tuple[int, int]:
    """(transformer tokens, prompt vision tokens) of one square condition image at the options' areas."""
    side = math.isqrt(getattr(options, "vae_image_area", 1024 * 1024))
    grid = side // scale // PATCH
    vl_side = max(VL_FACTOR * 2, round(math.isqrt(getattr(options, "vl_image_area", 384 * 384)) / VL_FACTOR) * VL_FACTOR)
    return grid * grid, (vl_side // VL_FACTOR) ** 2


def probe(config: Any, options: Any) -> DenoiserProbe:
    """The transformer at its width; inputs for ``rollout.height x width`` noisy tokens followed by one condition
    image's, and a prompt of ``TEXT_TOKENS`` plus the image's vision tokens."""
    from diffusers import QwenImageTransformer2DModel

    from omnirl_plugin_qwen_image_edit.model import QwenImageEditModel

    label, arch, _, scale = _architecture(config)
    dtype = plan.torch_dtype(config)
    h = config.rollout.height // scale // PATCH
    w = config.rollout.width // scale // PATCH
    image, vision = condition_tokens(options, scale)
    side = math.isqrt(image)
    text = TEXT_TOKENS + vision
    _, targets = plan.lora_settings(config, QwenImageEditModel.default_lora_targets)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {
            "hidden_states": torch.empty(batch, h * w + image, arch["in_channels"], **meta),
            "timestep": torch.empty(batch, **meta),
            "encoder_hidden_states": torch.empty(batch, text, arch["joint_attention_dim"], **meta),
            "img_shapes": [[(1, h, w), (1, side, side)]] * batch,
            "return_dict": False,
        }

    return DenoiserProbe(build=plan.layers_builder(QwenImageTransformer2DModel, arch, dtype),
                         layers=arch["num_layers"], blocks=lambda m: m.transformer_blocks,
                         inputs=inputs, lora_targets=targets,
                         key=(label, str(dtype), h, w, image, text, targets))


def decoder(config: Any) -> plan.DecoderProbe:
    """The VAE decode of images at the configured resolution (one frame)."""
    from diffusers import AutoencoderKLQwenImage

    label, _, vae, scale = _architecture(config)
    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // scale, config.rollout.width // scale
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKLQwenImage(**vae), dtype),
                            (vae["z_dim"], 1, h, w), dtype, key=(label, str(dtype), h, w))


def sizing(config: Any, options: Any) -> plan.ModelSizing:
    from omnirl_plugin_qwen_image_edit.model import QwenImageEditModel

    preset = "tiny" if config.model.preset == "tiny" else None
    components = _tiny_components() if preset else _components()
    out = plan.pipeline_sizing(config, components, ("transformer",), QwenImageEditModel.default_lora_targets,
                               components["transformer"].transformer_blocks, ("text_encoder", "vae"),
                               probe(config, options), decoder(config), preset=preset)
    image, vision = condition_tokens(options, _architecture(config)[3])
    out.notes.append(f"one condition image per prompt: {image} transformer tokens, {vision} prompt vision tokens")
    return out
