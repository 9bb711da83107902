"""The released Stable Diffusion 3.5 Medium and Large at full size, built on the ``meta`` device: every
component from its published configuration (MMDiT(-X) transformer, CLIP-L, OpenCLIP bigG, T5-XXL encoder, the
16-channel VAE), with no weights and no memory, to count parameters and plan memory before anything is
downloaded.

A count is the number of elements of the tensors a checkpoint of the module holds (each parameter once, plus
persistent buffers), so that it compares with a published size. The SD3 transformer's sin-cos positional table
(``pos_embed.pos_embed``, 384 x 384 x 1536 = 226M values for Medium) is such a buffer: it is in the released
checkpoint and in Stability's parameter figures.
"""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import (
    check_variant,
    component_counts,
    pipeline_training_bytes,
    published_counts,
)

VARIANTS = ("medium", "large")

_TRANSFORMER_COMMON = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "attention_head_dim": 64,
    "joint_attention_dim": 4096, "pooled_projection_dim": 2048, "qk_norm": "rms_norm",
}
# transformer/config.json of stabilityai/stable-diffusion-3.5-medium and -large
TRANSFORMERS = {
    "medium": {**_TRANSFORMER_COMMON, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
               "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13))},
    "large": {**_TRANSFORMER_COMMON, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
              "pos_embed_max_size": 192, "dual_attention_layers": ()},
}
# text_encoder/config.json (CLIP ViT-L/14's text tower), text_encoder_2/config.json (OpenCLIP ViT-bigG/14's),
# text_encoder_3/config.json (T5-v1.1-XXL's encoder): the same in both releases
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu"}
CLIP_G = {"vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
          "num_attention_heads": 20, "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu"}
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
          "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
# vae/config.json
VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
       "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2,
       "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 1.5305,
       "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False}


PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


def full_size_components(variant: str = "medium") -> dict[str, torch.nn.Module]:
    """The pipeline's modules by component name, on ``meta`` (no storage): seconds, no memory."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    check_variant("SD3.5", variant, VARIANTS)
    with torch.device("meta"):
        return {
            "transformer": SD3Transformer2DModel(**TRANSFORMERS[variant]),
            "text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L)),
            "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)),
            "text_encoder_3": T5EncoderModel(T5Config(**T5_XXL)),
            "vae": AutoencoderKL(**VAE),
        }


def parameter_counts(variant: str = "medium", components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Counts per component. ``components``: those ``full_size_components`` built (built here when None)."""
    return component_counts(components or full_size_components(variant))


# -- memory ----------------------------------------------------------------------------------------------------
TRAINED = ("transformer",)
"""The components training updates (the rest stays frozen)."""


def memory_estimate(variant: str = "medium", lora_rank: int | None = 64, dtype_bytes: int = 2, reference: bool = True,
                    use_t5: bool = True, components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Bytes training holds besides activations, as the torch train engine holds them: every component's weights
    (``weights/<component>``; ``use_t5=False`` leaves the T5 encoder out, as the plugin's option does); the
    trainable parameters (``adapters``: LoRA of ``lora_rank`` on the plugin's default targets; ``lora_rank=None``:
    the whole transformer, whose weights are already counted) with their ``gradients`` and AdamW's two moment
    buffers (``optimizer``); with full fine-tuning and a KL term (``reference``), a frozen copy of the transformer.
    Everything in the model dtype (``dtype_bytes``: 2 for bfloat16, 4 for float32): peft gives adapters the base
    layer's dtype and AdamW keeps its states in the parameter's. ``total`` sums them."""
    from omnirl_plugin_sd35.model import SD35Model

    c = dict(components or full_size_components(variant))
    if not use_t5:
        c.pop("text_encoder_3")
    return pipeline_training_bytes(c, TRAINED, SD35Model.default_lora_targets, lora_rank, dtype_bytes, reference)
