"""Qwen-Image for the memory planner (``omnirl plan``): the full-size architecture on ``meta`` at the configured
resolution and prompt length. See omnirl_core.plan."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.plan import model as plan
from omnirl_core.plan.activations import DenoiserProbe
from omnirl_plugin_qwen_image.full_size import TRANSFORMER, VAE, full_size_components

VAE_SCALE = 8
PATCH = 2


@functools.lru_cache(maxsize=1)
def _components() -> dict[str, torch.nn.Module]:
    return full_size_components()  # meta: no memory to keep


def probe(config: Any, options: Any) -> DenoiserProbe:
    """The transformer at full width; inputs for ``rollout.height x width`` and prompts of
    ``max_sequence_length`` tokens (the cap: a batch pads to its longest prompt)."""
    from diffusers import QwenImageTransformer2DModel

    from omnirl_plugin_qwen_image.model import QwenImageModel

    dtype = plan.torch_dtype(config)
    h = config.rollout.height // VAE_SCALE // PATCH
    w = config.rollout.width // VAE_SCALE // PATCH
    text = getattr(options, "max_sequence_length", 512)
    _, targets = plan.lora_settings(config, QwenImageModel.default_lora_targets)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {
            "hidden_states": torch.empty(batch, h * w, TRANSFORMER["in_channels"], **meta),
            "timestep": torch.empty(batch, **meta),
            "encoder_hidden_states": torch.empty(batch, text, TRANSFORMER["joint_attention_dim"], **meta),
            "img_shapes": [[(1, h, w)]] * batch,
            "return_dict": False,
        }

    return DenoiserProbe(build=plan.layers_builder(QwenImageTransformer2DModel, TRANSFORMER, dtype),
                         layers=TRANSFORMER["num_layers"], blocks=lambda m: m.transformer_blocks,
                         inputs=inputs, lora_targets=targets,
                         key=("qwen-image", str(dtype), h, w, text, targets))


def decoder(config: Any) -> plan.DecoderProbe:
    """The VAE decode of images at the configured resolution (one frame)."""
    from diffusers import AutoencoderKLQwenImage

    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // VAE_SCALE, config.rollout.width // VAE_SCALE
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKLQwenImage(**VAE), dtype),
                            (VAE["z_dim"], 1, h, w), dtype, key=("qwen-image", str(dtype), h, w))


def sizing(config: Any, options: Any) -> plan.ModelSizing:
    from omnirl_plugin_qwen_image.model import QwenImageModel

    components = _components()
    return plan.pipeline_sizing(config, components, ("transformer",), QwenImageModel.default_lora_targets,
                                components["transformer"].transformer_blocks, ("text_encoder", "vae"),
                                probe(config, options), decoder(config))
