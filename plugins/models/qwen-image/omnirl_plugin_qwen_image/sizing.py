"""Qwen-Image for the memory planner (``omnirl plan``): on ``meta`` at the configured resolution and prompt length,
the released architecture, or the tiny preset's when the run uses it. See omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning import model as plan
from omnirl_core.planning.activations import DenoiserProbe
from omnirl_plugin_qwen_image import tiny
from omnirl_plugin_qwen_image.full_size import TRANSFORMER, VAE, full_size_components

VAE_SCALE = 8
PATCH = 2


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
        return f"qwen-image-tiny-v{tiny.TINY_VERSION}", tiny.TRANSFORMER, tiny.VAE, tiny.VAE_SCALE
    return "qwen-image", TRANSFORMER, VAE, VAE_SCALE


def probe(config: Any, options: Any) -> DenoiserProbe:
    """The transformer at its width; inputs for ``rollout.height x width`` and prompts of
    ``max_sequence_length`` tokens (the cap: a batch pads to its longest prompt)."""
    from diffusers import QwenImageTransformer2DModel

    from omnirl_plugin_qwen_image.model import QwenImageModel

    label, arch, _, scale = _architecture(config)
    dtype = plan.torch_dtype(config)
    h = config.rollout.height // scale // PATCH
    w = config.rollout.width // scale // PATCH
    text = getattr(options, "max_sequence_length", 512)
    _, targets = plan.lora_settings(config, QwenImageModel.default_lora_targets)

    def inputs(module: torch.nn.Module, batch: int) -> dict[str, Any]:
        meta = {"device": "meta", "dtype": dtype}
        return {
            "hidden_states": torch.empty(batch, h * w, arch["in_channels"], **meta),
            "timestep": torch.empty(batch, **meta),
            "encoder_hidden_states": torch.empty(batch, text, arch["joint_attention_dim"], **meta),
            "img_shapes": [[(1, h, w)]] * batch,
            "return_dict": False,
        }

    return DenoiserProbe(build=plan.layers_builder(QwenImageTransformer2DModel, arch, dtype),
                         layers=arch["num_layers"], blocks=lambda m: m.transformer_blocks,
                         inputs=inputs, lora_targets=targets,
                         key=(label, str(dtype), h, w, text, targets))


def decoder(config: Any) -> plan.DecoderProbe:
    """The VAE decode of images at the configured resolution (one frame)."""
    from diffusers import AutoencoderKLQwenImage

    label, _, vae, scale = _architecture(config)
    dtype = plan.torch_dtype(config)
    h, w = config.rollout.height // scale, config.rollout.width // scale
    return plan.vae_decoder(lambda: plan.on_meta(lambda: AutoencoderKLQwenImage(**vae), dtype),
                            (vae["z_dim"], 1, h, w), dtype, key=(label, str(dtype), h, w))


def sizing(config: Any, options: Any) -> plan.ModelSizing:
    from omnirl_plugin_qwen_image.model import QwenImageModel

    preset = "tiny" if config.model.preset == "tiny" else None
    components = _tiny_components() if preset else _components()
    out = plan.pipeline_sizing(config, components, ("transformer",), QwenImageModel.default_lora_targets,
                               components["transformer"].transformer_blocks, ("text_encoder", "vae"),
                               probe(config, options), decoder(config), preset=preset)
    # Ulysses sequence parallelism splits the joint attention's heads over the group (the tokens elsewhere)
    _, arch, _, _ = _architecture(config)
    out.parallel_units["sequence"] = (int(arch["num_attention_heads"]), "attention heads")
    return out
