"""The ``tiny`` preset: the Qwen-Image architecture (diffusers transformer, VAE, Qwen2.5-VL text encoder)
with random weights and the real Qwen2 tokenizer, built locally in seconds and saved in the diffusers
layout so that it loads back through ``QwenImagePipeline.from_pretrained`` like a released checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VERSION = 2  # bump when the tiny architecture changes (invalidates the on-disk cache)
TEXT_HIDDEN = 16
# the tiny architecture, also what the memory planner builds on meta for the tiny preset (sizing.py)
TRANSFORMER = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 3, "joint_attention_dim": TEXT_HIDDEN, "guidance_embeds": False, "axes_dims_rope": (8, 4, 4),
}
VAE = {
    "base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1, "temperal_downsample": [False, True],
    "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4,
}
VAE_SCALE = 4  # two spatial downsamplings


def text_encoder_config(ids: dict[str, int], vocab: int) -> dict:
    """The tiny Qwen2.5-VL text encoder's configuration (``Qwen2_5_VLConfig`` keywords); ``ids``: the special
    tokens' ids by name."""
    return {
        "text_config": {
            "hidden_size": TEXT_HIDDEN,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": vocab,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1_000_000.0,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                          "out_hidden_size": TEXT_HIDDEN},
        "hidden_size": TEXT_HIDDEN,
        "vocab_size": vocab,
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|image_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }


def build_tiny_pipeline(seed: int = 0, tokenizer=None):
    """A QwenImagePipeline with random weights: transformer 2 layers / 3 heads x 16, VAE z_dim 4 (x4 spatial),
    text encoder hidden 16 / 2 layers with the full Qwen2 vocabulary."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omnirl_core.presets import QWEN2_VOCAB_SIZE, qwen2_tokenizer

    tokenizer = tokenizer or qwen2_tokenizer()
    vocab = max(QWEN2_VOCAB_SIZE, len(tokenizer))

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TRANSFORMER)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(**VAE)
    _widen_decoder_range(vae)
    torch.manual_seed(seed + 2)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in
           ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_end|>", "<|endoftext|>")}
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**text_encoder_config(ids, vocab))).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    )
    return QwenImagePipeline(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
    )


def _widen_decoder_range(vae) -> None:
    """A colour reward needs a decoder with dynamic range (see ``omnirl_core.presets.widen_decoder_range``)."""
    from omnirl_core.presets import widen_decoder_range

    widen_decoder_range(lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out,
                        (4, vae.config.z_dim, 1, 8, 8))


def save_tiny(directory: str | Path, seed: int = 0) -> Path:
    """Build the tiny preset and save it in the diffusers layout (``model_index.json`` + components)."""
    from omnirl_core.flow.model import save_pipeline

    return save_pipeline(build_tiny_pipeline(seed), directory)
