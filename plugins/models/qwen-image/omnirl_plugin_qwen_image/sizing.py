"""Qwen-Image for the memory planner (``omnirl plan``): the full-size architecture on ``meta`` at the configured
resolution and prompt length. See omnirl_core.plan."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.plan.activations import DenoiserProbe, meta_cast
from omnirl_core.plan.model import DecoderProbe, ModelSizing, lora_settings, torch_dtype, vae_decoder
from omnirl_core.plan.sizing import checkpoint_numel, trainable_numel
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

    dtype = torch_dtype(config)
    h = config.rollout.height // VAE_SCALE // PATCH
    w = config.rollout.width // VAE_SCALE // PATCH
    text = getattr(options, "max_sequence_length", 512)
    _, targets = lora_settings(config, QwenImageModel.default_lora_targets)

    def build(layers: int) -> torch.nn.Module:
        with torch.device("meta"):
            return meta_cast(QwenImageTransformer2DModel(**{**TRANSFORMER, "num_layers": layers}), dtype)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {
            "hidden_states": torch.empty(batch, h * w, TRANSFORMER["in_channels"], **meta),
            "timestep": torch.empty(batch, **meta),
            "encoder_hidden_states": torch.empty(batch, text, TRANSFORMER["joint_attention_dim"], **meta),
            "img_shapes": [[(1, h, w)]] * batch,
            "return_dict": False,
        }

    return DenoiserProbe(build=build, layers=TRANSFORMER["num_layers"], blocks=lambda m: m.transformer_blocks,
                         inputs=inputs, lora_targets=targets,
                         key=("qwen-image", str(dtype), h, w, text, targets))


def decoder(config: Any) -> DecoderProbe:
    """The VAE decode of images at the configured resolution (one frame)."""
    from diffusers import AutoencoderKLQwenImage

    dtype = torch_dtype(config)
    h, w = config.rollout.height // VAE_SCALE, config.rollout.width // VAE_SCALE

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return meta_cast(AutoencoderKLQwenImage(**VAE), dtype)

    return vae_decoder(build, (VAE["z_dim"], 1, h, w), dtype, key=("qwen-image", str(dtype), h, w))


def sizing(config: Any, options: Any) -> ModelSizing:
    from omnirl_plugin_qwen_image.model import QwenImageModel

    components = _components()
    rank, targets = lora_settings(config, QwenImageModel.default_lora_targets)
    transformer = components["transformer"]
    return ModelSizing(
        components={name: checkpoint_numel(m) for name, m in components.items()},
        trained=("transformer",),
        trainable=trainable_numel([transformer], targets, rank),
        lora=rank is not None,
        encoders=("text_encoder", "vae"),
        probe=probe(config, options),
        decoder=decoder(config),
        largest_block=max(checkpoint_numel(b) for b in transformer.transformer_blocks),
    )
