"""The ``tiny`` preset: the FLUX.1 architecture (double- and single-stream transformer blocks, CLIP and T5 text
encoders, the 16-channel-style VAE with shift and scale) with random weights and locally trained tokenizers,
built in seconds and saved in the diffusers layout so that it loads back through ``FluxPipeline.from_pretrained``
like a released checkpoint. ``dev`` has a guidance embedding and a size-shifted schedule; ``schnell`` neither;
``kontext`` is dev's architecture saved as a ``FluxKontextPipeline`` (FLUX.1 Kontext's layout)."""

from __future__ import annotations

import torch

from omnirl_core import presets

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)
VARIANTS = ("dev", "schnell")  # flux.1's tiny_variant
KONTEXT = "kontext"  # flux.1-kontext's: dev's architecture, saved as a FluxKontextPipeline
CLIP_DIM, T5_DIM, LATENT_CHANNELS = 32, 32, 4
T5 = {"d_model": T5_DIM, "d_kv": 8, "d_ff": 37}
# the tiny architecture, also what the memory planner builds on meta for the tiny preset (sizing.py); the
# transformer's guidance embedding follows the variant (dev: one, schnell: none)
TRANSFORMER = {
    "patch_size": 1, "in_channels": 4 * LATENT_CHANNELS, "num_layers": 1, "num_single_layers": 1,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": T5_DIM,
    "pooled_projection_dim": CLIP_DIM, "axes_dims_rope": (4, 6, 6),
}
VAE = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 3,
    "up_block_types": ("UpDecoderBlock2D",) * 3, "block_out_channels": (16, 32, 32), "layers_per_block": 1,
    "latent_channels": LATENT_CHANNELS, "norm_num_groups": 8, "sample_size": 32, "use_quant_conv": False,
    "use_post_quant_conv": False, "shift_factor": 0.1159, "scaling_factor": 0.3611,
}
VAE_SCALE = 4  # two spatial downsamplings


def build_tiny_pipeline(variant: str = "dev", seed: int = 0):
    """A FluxPipeline (FluxKontextPipeline for ``kontext``) with random weights: transformer 1 double + 1 single
    block, 2 heads x 16 (rotary axes 4/6/6), VAE with 4 latent channels (x4), CLIP hidden 32 / 2 layers, T5 d_model
    32 / 2 layers."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    if variant not in (*VARIANTS, KONTEXT):
        raise ValueError(f"unknown FLUX.1 variant {variant!r}; expected one of {(*VARIANTS, KONTEXT)}")
    tokenizer, tokenizer_2 = presets.clip_tokenizer(), presets.t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**TRANSFORMER, guidance_embeds=variant != "schnell")
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**VAE)
    presets.widen_decoder_range(lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out,
                        (2, LATENT_CHANNELS, 8, 8))
    text_encoder = presets.tiny_clip_text_encoder(tokenizer, CLIP_DIM, seed + 2)
    text_encoder_2 = presets.tiny_t5_encoder(tokenizer_2, **T5, seed=seed + 3)
    if variant != "schnell":  # the released dev (and Kontext) scheduler: shift by image size
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:  # schnell: no shift
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    pipeline_cls = FluxKontextPipeline if variant == KONTEXT else FluxPipeline
    return pipeline_cls(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
