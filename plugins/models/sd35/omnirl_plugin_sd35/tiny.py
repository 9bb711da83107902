"""The ``tiny`` preset: the SD3.5 architecture (MMDiT, two CLIP text encoders with projections, a T5
encoder, the 16-channel VAE) with random weights and locally trained tokenizers, built in seconds and saved
in the diffusers layout so that it loads back through ``StableDiffusion3Pipeline.from_pretrained`` like a
released checkpoint.

Layouts: ``medium`` has MMDiT-X blocks (a second self-attention over the image tokens, ``dual_attention_layers``)
and QK RMS-norm, as SD3.5 Medium; ``large`` has plain MMDiT blocks with QK RMS-norm, as SD3.5 Large. The
text side mirrors the released one at small width: two CLIP hidden states concatenated and zero-padded to
the T5 width, pooled CLIP projections concatenated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl_core.presets import (
    clip_tokenizer,
    t5_tokenizer,
    tiny_clip_text_encoder,
    tiny_t5_encoder,
    widen_decoder_range,
)

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)
LAYOUTS = ("medium", "large")
CLIP_DIM = 32  # each CLIP: hidden and projection width
T5_DIM = 64  # >= 2 * CLIP_DIM: the concatenated CLIP states are zero-padded to it


def build_tiny_pipeline(layout: str = "medium", seed: int = 0):
    """A StableDiffusion3Pipeline with random weights: transformer 2 layers / 4 heads x 8 (patch 2),
    VAE 16 latent channels (x4 spatial), CLIPs hidden 32 / 2 layers, T5 d_model 64 / 2 layers."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    if layout not in LAYOUTS:
        raise ValueError(f"unknown SD3.5 layout {layout!r}; expected one of {LAYOUTS}")
    tokenizer, tokenizer_3 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=T5_DIM, caption_projection_dim=32, pooled_projection_dim=2 * CLIP_DIM,
        pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0,) if layout == "medium" else (),
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )
    widen_decoder_range(lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out, (2, 16, 4, 4))
    text_encoder_3 = tiny_t5_encoder(tokenizer_3, d_model=T5_DIM, d_kv=16, d_ff=64, seed=seed + 2)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=tiny_clip_text_encoder(tokenizer, CLIP_DIM, seed + 3, projection=True),
        tokenizer=tokenizer,
        text_encoder_2=tiny_clip_text_encoder(tokenizer, CLIP_DIM, seed + 4, projection=True),
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def save_tiny(directory: str | Path, layout: str = "medium", seed: int = 0) -> Path:
    """Build the tiny preset and save it in the diffusers layout (``model_index.json`` + components)."""
    from omnirl_core.flow.model import save_pipeline

    return save_pipeline(build_tiny_pipeline(layout, seed), directory)
