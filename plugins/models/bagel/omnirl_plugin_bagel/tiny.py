"""The ``tiny`` preset: BAGEL's architecture (MoT Qwen2 with QK-norm and GQA, the generation heads, the FLUX
autoencoder, a SigLIP tower in the checkpoint) with random weights and the real Qwen2 tokenizer, saved in the
released ``BAGEL-7B-MoT`` layout so that it loads back through the same code as the released checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from omnirl_plugin_bagel.config import VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR, BagelConfig, LLMConfig
from omnirl_plugin_bagel.transformer import BagelTransformer
from omnirl_plugin_bagel.vae import AutoEncoder, AutoEncoderParams

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)

TINY_LLM = LLMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64, vocab_size=152064)
TINY_VAE = AutoEncoderParams(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1, z_channels=16)
TINY_VIT = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 3, "patch_size": 14, "image_size": 224, "num_channels": 3,
            "vision_use_head": False}
"""The ViT is stored (two layers, as the release stores 26 of its configuration's 27) but never built."""


def tiny_config() -> BagelConfig:
    return BagelConfig(llm=TINY_LLM, max_latent_size=8, timestep_shift=1.0, vit=dict(TINY_VIT))


def _vit_weights(hidden: int) -> dict[str, torch.Tensor]:
    """A random SigLIP vision tower in the released naming (``vit_model.vision_model.*``, the patch embedding
    as a linear layer over (kh, kw, c)), its connector and its position table: only for the layout."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(**{k: v for k, v in TINY_VIT.items() if k != "model_type"})
    config.num_hidden_layers -= 1
    state = {f"vit_model.vision_model.{k}": v for k, v in SiglipVisionModel(config).state_dict().items()}
    conv = state.pop("vit_model.vision_model.embeddings.patch_embedding.weight")
    state["vit_model.vision_model.embeddings.patch_embedding.weight"] = conv.permute(0, 2, 3, 1).reshape(conv.shape[0], -1)
    width = config.hidden_size
    state.update({
        "connector.fc1.weight": torch.randn(hidden, width) * 0.02, "connector.fc1.bias": torch.zeros(hidden),
        "connector.fc2.weight": torch.randn(hidden, hidden) * 0.02, "connector.fc2.bias": torch.zeros(hidden),
        "vit_pos_embed.pos_embed": torch.zeros((config.image_size // config.patch_size) ** 2, hidden),
    })
    return state


def build_tiny(seed: int = 0) -> tuple[BagelConfig, BagelTransformer, AutoEncoder]:
    from omnirl_core.presets import widen_decoder_range

    config = tiny_config()
    torch.manual_seed(seed)
    transformer = BagelTransformer(config)
    torch.manual_seed(seed + 1)
    vae = AutoEncoder(TINY_VAE, VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR)
    widen_decoder_range(vae.decode, vae.decoder.conv_out, (4, TINY_VAE.z_channels, 8, 8))
    return config, transformer, vae


def save_tiny(directory: str | Path, seed: int = 0) -> Path:
    """Build the tiny preset and save it in the released layout (config files, ema.safetensors with the LM head
    and a SigLIP tower as in the release, ae.safetensors, the real Qwen2 tokenizer)."""
    from omnirl_core.presets import qwen2_tokenizer
    from omnirl_plugin_bagel.checkpoint import save_checkpoint

    directory = Path(directory)
    config, transformer, vae = build_tiny(seed)
    torch.manual_seed(seed + 2)
    weights = dict(transformer.state_dict())
    weights["language_model.lm_head.weight"] = torch.randn(config.llm.vocab_size, config.llm.hidden_size) * 0.02
    weights.update(_vit_weights(config.llm.hidden_size))
    save_checkpoint(directory, config, weights, vae.state_dict(), qwen2_tokenizer())
    return directory
