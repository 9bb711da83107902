"""The released FLUX.1 dev and schnell at full size, built on the ``meta`` device from their published
configurations (transformer, CLIP-L text tower, T5-v1.1-XXL encoder, the 16-channel VAE): no weights, no memory,
to count parameters and plan memory before anything is downloaded. A count is the number of elements a
checkpoint of the module holds (``omnirl_core.planning.sizing.checkpoint_numel``)."""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import checkpoint_numel, published_counts

VARIANTS = ("dev", "schnell")

# transformer/config.json of black-forest-labs/FLUX.1-dev and -schnell: they differ in the guidance embedding only
TRANSFORMER = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
    "axes_dims_rope": (16, 56, 56),
}
# text_encoder/config.json (CLIP ViT-L/14's text tower, no projection), text_encoder_2/config.json (T5-v1.1-XXL)
CLIP = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu"}
T5 = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
      "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
# vae/config.json
VAE = {"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
       "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "latent_channels": 16,
       "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False}

PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


def full_size_components(variant: str = "dev") -> dict[str, torch.nn.Module]:
    """The pipeline's modules by component name, on ``meta`` (no storage): seconds, no memory."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if variant not in VARIANTS:
        raise ValueError(f"unknown FLUX.1 variant {variant!r}; expected one of {VARIANTS}")
    with torch.device("meta"):
        return {
            "transformer": FluxTransformer2DModel(**TRANSFORMER, guidance_embeds=variant == "dev"),
            "text_encoder": CLIPTextModel(CLIPTextConfig(**CLIP)),
            "text_encoder_2": T5EncoderModel(T5Config(**T5)),
            "vae": AutoencoderKL(**VAE),
        }


def parameter_counts(variant: str = "dev", components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    return {name: checkpoint_numel(m) for name, m in (components or full_size_components(variant)).items()}
