"""The released Wan2.2 text-to-video models at full size, built on the ``meta`` device: every component from
its published configuration, with no weights and no memory, to count parameters and plan memory before
anything is downloaded.

- ``a14b`` (Wan-AI/Wan2.2-T2V-A14B-Diffusers): two expert transformers (``transformer`` for high noise,
  ``transformer_2`` for low noise) of identical shape, the Wan-2.1 VAE, the UMT5-XXL encoder.
- ``ti2v-5b`` (Wan-AI/Wan2.2-TI2V-5B-Diffusers): one transformer, the Wan-2.2 VAE (48 channels), UMT5-XXL.

A count is the number of elements of the tensors a checkpoint of the module holds (each parameter once, plus
persistent buffers), so that it compares with a published size.
"""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import (
    check_variant,
    component_counts,
    pipeline_training_bytes,
    published_counts,
)

VARIANTS = ("a14b", "ti2v-5b")

_TRANSFORMER_COMMON = {
    "patch_size": (1, 2, 2), "attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}
# transformer/config.json (and transformer_2/config.json, the same) of each release
TRANSFORMERS = {
    "a14b": {**_TRANSFORMER_COMMON, "num_attention_heads": 40, "in_channels": 16, "out_channels": 16,
             "ffn_dim": 13824, "num_layers": 40},
    "ti2v-5b": {**_TRANSFORMER_COMMON, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                "ffn_dim": 14336, "num_layers": 30},
}
# vae/config.json (latents_mean / latents_std hold no parameters)
VAES = {
    "a14b": {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
             "temperal_downsample": [False, True, True]},
    "ti2v-5b": {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                "attn_scales": [], "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12,
                "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4},
}
# text_encoder/config.json of both releases (google/umt5-xxl's encoder)
TEXT_ENCODER = {
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False, "scalable_attention": True,
}


PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


def full_size_components(variant: str = "a14b") -> dict[str, torch.nn.Module]:
    """The pipeline's modules by component name, on ``meta`` (no storage): seconds, no memory."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    check_variant("Wan2.2", variant, VARIANTS)
    with torch.device("meta"):
        components = {"transformer": WanTransformer3DModel(**TRANSFORMERS[variant])}
        if variant == "a14b":
            components["transformer_2"] = WanTransformer3DModel(**TRANSFORMERS[variant])
        components["vae"] = AutoencoderKLWan(**VAES[variant])
        components["text_encoder"] = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER))
    return components


def parameter_counts(variant: str = "a14b", components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Counts per component. ``components``: those ``full_size_components`` built (built here when None)."""
    return component_counts(components or full_size_components(variant))


# -- memory ----------------------------------------------------------------------------------------------------
TRAINED = {"a14b": ("transformer", "transformer_2"), "ti2v-5b": ("transformer",)}
"""The components training updates by default (A14B: both experts, ``train_experts: both``)."""


def memory_estimate(variant: str = "a14b", lora_rank: int | None = 64, dtype_bytes: int = 2, reference: bool = True,
                    trained: tuple[str, ...] | None = None,
                    components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Bytes training holds besides activations, as the torch train engine holds them: every component's weights
    (``weights/<component>``, both experts of A14B); the trainable parameters (``adapters``: LoRA of ``lora_rank`` on
    the plugin's default targets of every trained expert; ``lora_rank=None``: the trained experts whole, whose
    weights are already counted) with their ``gradients`` and AdamW's two moment buffers (``optimizer``); with full
    fine-tuning and a KL term (``reference``), a frozen copy of each trained expert. ``trained``: the experts
    trained (default: ``TRAINED[variant]``). Everything in the model dtype (``dtype_bytes``: 2 for bfloat16, 4 for
    float32): peft gives adapters the base layer's dtype and AdamW keeps its states in the parameter's. ``total``
    sums them."""
    from omnirl_plugin_wan22.model import Wan22Model

    return pipeline_training_bytes(components or full_size_components(variant), trained or TRAINED[variant],
                                   Wan22Model.default_lora_targets, lora_rank, dtype_bytes, reference)
