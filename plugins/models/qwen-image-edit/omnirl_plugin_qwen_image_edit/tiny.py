"""The ``tiny`` preset: the Qwen-Image-Edit architecture (Qwen-Image's MMDiT, its VAE, a Qwen2.5-VL text encoder whose
vision tower sees the condition images) with random weights and the real Qwen2 tokenizer, built locally in seconds
and saved in the diffusers layout (``model_index.json`` names ``QwenImageEditPlusPipeline`` or
``QwenImageEditPipeline`` and a ``Qwen2VLProcessor``), so that it loads back like a released checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VERSION = 2  # bump when the tiny architecture changes (invalidates the on-disk cache)
VARIANTS = {"edit-plus": "QwenImageEditPlusPipeline", "edit": "QwenImageEditPipeline"}
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
VISION = {"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN}
# what the tiny vision tower sees: at least 56 x 56 (the processor's smallest), at most 112 x 112 pixels
IMAGE_PROCESSOR = {"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}}
SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_end|>", "<|endoftext|>")


def text_encoder_config(ids: dict[str, int], vocab: int) -> dict:
    """The tiny Qwen2.5-VL text encoder's configuration (``Qwen2_5_VLConfig`` keywords); ``ids``: the special
    tokens' ids by name."""
    return {
        "text_config": {
            "hidden_size": TEXT_HIDDEN, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "vocab_size": vocab, "rope_theta": 1_000_000.0,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        },
        "vision_config": VISION, "hidden_size": TEXT_HIDDEN, "vocab_size": vocab,
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|image_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }


def normalise_encoder(vae, images: int = 32, size: int = 32) -> None:
    """Rescale the VAE encoder's last (1 x 1) convolution so that its latents have zero mean and unit spread per
    channel over blocky random-colour pictures: still random weights, only another init scale, as
    ``widen_decoder_range`` does for the decoder.

    A random encoder maps every picture to nearly the same latent (per channel an offset of about 0.3 and a spread
    under 0.1), while the noisy tokens the transformer sees beside them are unit Gaussian: the edit's condition tokens
    then barely differ between sources, and the model can neither see its source nor learn to keep it. A released
    checkpoint's ``latents_mean`` / ``latents_std`` make its latents unit-scale; the tiny preset keeps 0 / 1 and makes
    the encoder's output match them instead, so that decoding (already widened for unit latents) is unchanged."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.rand(images, 3, 4, 4, generator=generator) * 2 - 1
    pictures = torch.nn.functional.interpolate(blocks, size=(size, size), mode="nearest").unsqueeze(2)
    with torch.no_grad():
        mu = vae.encode(pictures).latent_dist.mode()  # (N, C, 1, h, w): what the edit pipelines encode a source to
        mean, std = mu.mean(dim=(0, 2, 3, 4)), mu.std(dim=(0, 2, 3, 4)).clamp_min(1e-6)
        channels = mean.shape[0]  # the mean's rows of the (mean, log-variance) convolution
        conv = vae.quant_conv
        conv.weight[:channels] /= std.view(-1, 1, 1, 1, 1)
        conv.bias[:channels] = (conv.bias[:channels] - mean) / std


def build_tiny_pipeline(variant: str = "edit-plus", seed: int = 0, tokenizer=None):
    """A Qwen-Image-Edit(-Plus) pipeline with random weights: transformer 2 layers / 3 heads x 16, VAE z_dim 4 (x4
    spatial), text encoder hidden 16 / 2 layers with a 2-block vision tower and the full Qwen2 vocabulary."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from omnirl_core.presets import QWEN2_VOCAB_SIZE, qwen2_tokenizer, widen_decoder_range
    from omnirl_plugin_qwen_image_edit.processor import QwenVLInputs

    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen-Image-Edit variant {variant!r}; expected one of {sorted(VARIANTS)}")
    tokenizer = tokenizer or qwen2_tokenizer()
    vocab = max(QWEN2_VOCAB_SIZE, len(tokenizer))
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**TRANSFORMER)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(**VAE)
    # a colour reward needs a decoder with dynamic range (see omnirl_core.presets.widen_decoder_range), an edit an
    # encoder whose latents tell sources apart
    normalise_encoder(vae)
    widen_decoder_range(lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out,
                        (4, vae.config.z_dim, 1, 8, 8))
    torch.manual_seed(seed + 2)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**text_encoder_config(ids, vocab))).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    )
    processor = QwenVLInputs(Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR), tokenizer)
    return getattr(diffusers, VARIANTS[variant])(transformer=transformer, vae=vae, text_encoder=text_encoder,
                                                 tokenizer=tokenizer, processor=processor, scheduler=scheduler)


def save_pipeline(pipeline, directory: str | Path) -> Path:
    """Save in the released layout: diffusers writes every component but the processor, which is written here with
    what ``Qwen2VLProcessor.from_pretrained`` reads (``model_index.json`` names it so)."""
    directory = Path(directory)
    pipeline.save_pretrained(str(directory), safe_serialization=True)
    pipeline.processor.save_pretrained(directory / "processor")
    index = json.loads((directory / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def save_tiny(directory: str | Path, variant: str = "edit-plus", seed: int = 0) -> Path:
    """Build the tiny preset and save it in the diffusers layout."""
    return save_pipeline(build_tiny_pipeline(variant, seed), directory)
