"""The ``tiny`` preset: the Wan2.2 text-to-video architecture in either layout, with random weights and a
locally trained UMT5-style tokenizer, built in seconds and saved in the diffusers layout so that it loads
back through ``WanPipeline.from_pretrained`` like a released checkpoint.

- ``a14b``: two expert transformers (``transformer`` for high noise, ``transformer_2`` for low noise)
  switched at ``boundary_ratio``, the 16-channel Wan VAE.
- ``ti2v-5b``: one transformer with per-token timesteps, the 48-channel Wan2.2 VAE (residual, 2x2 pixel
  patches).

Both tiny VAEs compress x4 / x8 spatially and x2 in time (released: x8 / x16 and x4): one level fewer
keeps 16x16 videos of 5 frames cheap to decode on a CPU, and lets random decoder weights move the decoded
colours with the latent (a colour reward has room to rise). The model reads the factors from the VAE
config, so nothing else changes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl_core.presets import t5_tokenizer, tiny_t5_encoder, widen_decoder_range

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)
TEXT_DIM = 32
LAYOUTS = ("a14b", "ti2v-5b")


def _transformer(channels: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=channels,
        out_channels=channels,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def build_tiny_pipeline(layout: str = "a14b", seed: int = 0):
    """A WanPipeline with random weights: transformer(s) 2 layers / 2 heads x 12, UMT5 encoder d_model 32 /
    2 layers, VAE base_dim 8 with one residual block per level."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    if layout not in LAYOUTS:
        raise ValueError(f"unknown Wan2.2 layout {layout!r}; expected one of {LAYOUTS}")
    tokenizer = t5_tokenizer()
    torch.manual_seed(seed + 1)
    if layout == "a14b":
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=16, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            scale_factor_spatial=4, scale_factor_temporal=2,
        )
    else:
        vae = AutoencoderKLWan(
            base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1], num_res_blocks=1,
            scale_factor_spatial=8, scale_factor_temporal=2, temperal_downsample=[False, True],
        )
    widen_decoder_range(
        lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out, (2, vae.config.z_dim, 2, 2, 2)
    )
    torch.manual_seed(seed)
    transformer = _transformer(vae.config.z_dim)
    transformer_2 = None
    if layout == "a14b":
        torch.manual_seed(seed + 3)
        transformer_2 = _transformer(vae.config.z_dim)
    text_encoder = tiny_t5_encoder(tokenizer, d_model=TEXT_DIM, d_kv=8, d_ff=37, seed=seed + 2, umt5=True)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0 if layout == "a14b" else 5.0
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=0.875 if layout == "a14b" else None,
        expand_timesteps=layout == "ti2v-5b",
    )


def save_tiny(directory: str | Path, layout: str = "a14b", seed: int = 0) -> Path:
    """Build the tiny preset and save it in the diffusers layout (``model_index.json`` + components)."""
    from omnirl_core.flow.model import save_pipeline

    return save_pipeline(build_tiny_pipeline(layout, seed), directory)
