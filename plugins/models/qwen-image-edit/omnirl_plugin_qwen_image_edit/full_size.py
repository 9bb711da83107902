"""The released Qwen-Image-Edit (Qwen/Qwen-Image-Edit, -2509, -2511) at full size, built on the ``meta`` device:
every component from its published configuration, with no weights and no memory, to count parameters and plan
memory before anything is downloaded. The edit checkpoints keep Qwen-Image's architecture (the 20B MMDiT, the
Wan-2.1 VAE, the Qwen2.5-VL-7B text encoder, whose vision tower now sees the condition images); what editing adds
is sequence length (the condition images' tokens), which the sizing's activation probe counts."""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import checkpoint_numel, component_counts, published_counts

# Qwen/Qwen-Image-Edit-2509 transformer/config.json (the same as Qwen/Qwen-Image's)
TRANSFORMER = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}
# vae/config.json (the Wan-2.1 VAE architecture); latents_mean / latents_std hold no parameters
VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
}
# text_encoder/config.json = Qwen/Qwen2.5-VL-7B-Instruct config.json
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


def full_size_components() -> dict[str, torch.nn.Module]:
    """The pipeline's modules by component name, on ``meta`` (no storage): seconds, no memory."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        return {
            "transformer": QwenImageTransformer2DModel(**TRANSFORMER),
            "vae": AutoencoderKLQwenImage(**VAE),
            "text_encoder": Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**TEXT_ENCODER)),
        }


def parameter_counts(components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Counts per component, and of the text encoder's vision tower (``text_encoder.visual``: what reads the
    condition images)."""
    c = components or full_size_components()
    return {**component_counts(c), "text_encoder.visual": checkpoint_numel(c["text_encoder"].model.visual)}
