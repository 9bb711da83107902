"""The ``tiny`` preset: the FLUX.1 architecture (double- and single-stream transformer blocks, CLIP and T5 text
encoders, the 16-channel-style VAE with shift and scale) with random weights and locally trained tokenizers,
built in seconds and saved in the diffusers layout so that it loads back through ``FluxPipeline.from_pretrained``
like a released checkpoint. ``dev`` has a guidance embedding and a size-shifted schedule; ``schnell`` neither;
``kontext`` is dev's architecture saved as a ``FluxKontextPipeline`` (FLUX.1 Kontext's layout)."""

from __future__ import annotations

import torch

from omnirl_core import presets

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)
# flux.1-kontext's own: v2 scales the encoder to unit-spread source latents (normalise_encoder)
KONTEXT_VERSION = 2
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


def normalise_encoder(vae, images: int = 32, size: int = 32) -> None:
    """Rescale the VAE encoder's last convolution (the rows giving the posterior's mean) so that blocky random-colour
    pictures encode, after the pipeline's shift and scale, to latents of zero mean and unit spread per channel: still
    random weights, only another init scale, as ``presets.widen_decoder_range`` does for the decoder.

    Left as built, the random encoder maps every picture to nearly the same latents (a spread near 0.1 per channel
    after shift and scale), while the noisy tokens Kontext appends them to are unit Gaussian: the sources then look
    alike to the transformer, which can neither see what to keep nor learn to keep it. Decoding is unchanged."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.rand(images, 3, 4, 4, generator=generator) * 2 - 1
    pictures = torch.nn.functional.interpolate(blocks, size=(size, size), mode="nearest")
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    with torch.no_grad():
        mu = vae.encode(pictures).latent_dist.mode()  # (N, C, h, w): what FluxKontextPipeline encodes a source to
        mean, std = mu.mean(dim=(0, 2, 3)), mu.std(dim=(0, 2, 3)).clamp_min(1e-6)
        gain = 1.0 / (scale * std)  # (mu - shift) * scale has unit spread
        channels = mean.shape[0]  # the mean's rows of the (mean, log-variance) convolution
        conv = vae.encoder.conv_out
        conv.weight[:channels] *= gain.view(-1, 1, 1, 1)
        conv.bias[:channels] = (conv.bias[:channels] - mean) * gain + shift


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
    if variant == KONTEXT:  # an editing model must tell its sources apart (normalise_encoder)
        normalise_encoder(vae)
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
