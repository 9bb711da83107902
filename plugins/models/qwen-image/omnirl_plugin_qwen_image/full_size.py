"""The released Qwen-Image at full size, built on the ``meta`` device: every component from its published
configuration (transformer, VAE, Qwen2.5-VL text encoder), with no weights and no memory, to count
parameters and plan memory before anything is downloaded.

A count is the number of elements of the tensors a checkpoint of the module holds (each parameter once, plus
persistent buffers), so that it compares with a published size.
"""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import (
    check_variant,
    checkpoint_numel,
    component_counts,
    pipeline_training_bytes,
    published_counts,
)

VARIANTS = ("qwen-image",)

# Qwen/Qwen-Image transformer/config.json
TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}
# Qwen/Qwen-Image vae/config.json (the Wan-2.1 VAE architecture); latents_mean / latents_std hold no parameters
VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}
# Qwen/Qwen-Image text_encoder/config.json = Qwen/Qwen2.5-VL-7B-Instruct config.json
TEXT_ENCODER = {
    "text_config": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "in_channels": 3,
    },
    "vocab_size": 152064, "hidden_size": 3584, "tie_word_embeddings": False,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}


PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


def full_size_components(variant: str = "qwen-image") -> dict[str, torch.nn.Module]:
    """The pipeline's modules by component name, on ``meta`` (no storage): seconds, no memory."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    check_variant("Qwen-Image", variant, VARIANTS)
    with torch.device("meta"):
        return {
            "transformer": QwenImageTransformer2DModel(**TRANSFORMER),
            "vae": AutoencoderKLQwenImage(**VAE),
            "text_encoder": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**TEXT_ENCODER)),
        }


def parameter_counts(variant: str = "qwen-image",
                     components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Counts per component, and of the parts published on their own: ``vae.encoder`` / ``vae.decoder``,
    ``text_encoder.text`` (the Qwen2.5-7B decoder with its LM head) and ``text_encoder.visual`` (the ViT and its
    merger). ``components``: those ``full_size_components`` built (built here when None)."""
    c = components or full_size_components(variant)
    text_encoder = c["text_encoder"]
    counts = component_counts(c)
    counts.update({
        "vae.encoder": checkpoint_numel(c["vae"].encoder),
        "vae.decoder": checkpoint_numel(c["vae"].decoder),
        "text_encoder.text": checkpoint_numel(text_encoder.model.language_model) + checkpoint_numel(text_encoder.lm_head),
        "text_encoder.visual": checkpoint_numel(text_encoder.model.visual),
    })
    return counts


# -- memory ----------------------------------------------------------------------------------------------------
TRAINED = {"qwen-image": ("transformer",)}
"""The components training updates (the rest stays frozen)."""


def memory_estimate(variant: str = "qwen-image", lora_rank: int | None = 64, dtype_bytes: int = 2,
                    reference: bool = True, components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Bytes training holds besides activations, as the torch train engine holds them: every component's weights
    (``weights/<component>``); the trainable parameters (``adapters``: LoRA of ``lora_rank`` on the plugin's default
    targets; ``lora_rank=None``: the whole transformer, whose weights are already counted) with their
    ``gradients`` and AdamW's two moment buffers (``optimizer``); with full fine-tuning and a KL term
    (``reference``), a frozen copy of the transformer. Everything in the model dtype (``dtype_bytes``: 2 for
    bfloat16, 4 for float32): peft gives adapters the base layer's dtype and AdamW keeps its states in the
    parameter's. ``total`` sums them."""
    from omnirl_plugin_qwen_image.model import QwenImageModel

    return pipeline_training_bytes(components or full_size_components(variant), TRAINED[variant],
                                   QwenImageModel.default_lora_targets, lora_rank, dtype_bytes, reference)
