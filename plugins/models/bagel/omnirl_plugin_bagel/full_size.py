"""The released BAGEL-7B-MoT at full size, built on the ``meta`` device from its published configuration
(``llm_config.json``: Qwen2.5-7B; ``vit_config.json``: SigLIP so400m/14 with 26 of 27 layers kept; the FLUX
autoencoder), with no weights and no memory, to count parameters and plan memory before a download.

``ema.safetensors`` holds the language model (both experts, embeddings, LM head), the generation heads and the
understanding parts (ViT, connector, position table); ``ae.safetensors`` the autoencoder. A count is the
number of elements of the tensors a checkpoint of the module holds (each parameter once, persistent buffers).
"""

from __future__ import annotations

import torch
from torch import nn

from omnirl_core.planning.sizing import (
    check_variant,
    checkpoint_numel,
    lora_numel,
    published_counts,
    training_bytes,
)
from omnirl_plugin_bagel.config import VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR, BagelConfig, LLMConfig
from omnirl_plugin_bagel.model import LORA_TARGETS
from omnirl_plugin_bagel.transformer import BagelTransformer
from omnirl_plugin_bagel.vae import AutoEncoder, AutoEncoderParams

VARIANTS = ("bagel-7b-mot",)

# BAGEL-7B-MoT llm_config.json (Qwen2.5-7B-Instruct) with the fields BAGEL's loader forces
LLM = LLMConfig(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# vit_config.json (SigLIP so400m, patch 14, 980 px); BAGEL runs 26 of its 27 layers and stores those
VIT = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 26,
       "patch_size": 14, "image_size": 980, "num_channels": 3, "vision_use_head": False}
MAX_LATENT_SIZE = 64
VAE = AutoEncoderParams(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=16)

PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


class _Understanding(nn.Module):
    """The understanding parts ``ema.safetensors`` holds and text-to-image does not build: the SigLIP tower, its
    MLP connector into the language model and the frozen ViT position table; with the LM head."""

    def __init__(self, hidden: int):
        from transformers import SiglipVisionConfig, SiglipVisionModel

        super().__init__()
        self.vit_model = SiglipVisionModel(SiglipVisionConfig(**VIT))
        self.connector = nn.Module()
        self.connector.fc1 = nn.Linear(VIT["hidden_size"], hidden)
        self.connector.fc2 = nn.Linear(hidden, hidden)
        side = VIT["image_size"] // VIT["patch_size"]
        self.vit_pos_embed = nn.Parameter(torch.empty(side * side, hidden), requires_grad=False)
        self.lm_head = nn.Linear(hidden, LLM.vocab_size, bias=False)


def full_size_components(variant: str = "bagel-7b-mot") -> dict[str, nn.Module]:
    """``transformer`` (what this plugin builds and trains), ``understanding`` (stored, not built) and ``vae``,
    on ``meta``: seconds, no memory."""
    check_variant("BAGEL", variant, VARIANTS)
    with torch.device("meta"):
        return {
            "transformer": BagelTransformer(BagelConfig(llm=LLM, max_latent_size=MAX_LATENT_SIZE)),
            "understanding": _Understanding(LLM.hidden_size),
            "vae": AutoEncoder(VAE, VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR),
        }


def parameter_counts(variant: str = "bagel-7b-mot", components: dict[str, nn.Module] | None = None) -> dict[str, int]:
    """Counts per component and per published part: ``language_model`` (both experts, embeddings, LM head),
    ``language_model.active`` (one expert's path: embeddings, understanding layers, final norm, LM head),
    ``language_model.gen_expert`` (the generation expert's layer weights and final norm), ``generation_heads``,
    ``vit``, ``ema`` (everything ``ema.safetensors`` holds) and ``vae``."""
    c = components or full_size_components(variant)
    transformer, und = c["transformer"], c["understanding"]
    llm = transformer.language_model.model
    layer_params = {n: p.numel() for n, p in llm.layers.named_parameters()}
    gen_layers = sum(v for n, v in layer_params.items() if "_moe_gen" in n)
    und_layers = sum(layer_params.values()) - gen_layers
    embed, lm_head = llm.embed_tokens.weight.numel(), und.lm_head.weight.numel()
    heads = checkpoint_numel(transformer) - checkpoint_numel(transformer.language_model)
    vit = checkpoint_numel(und.vit_model)
    return {
        "transformer": checkpoint_numel(transformer),
        "language_model": checkpoint_numel(transformer.language_model) + lm_head,
        "language_model.active": embed + und_layers + llm.norm.weight.numel() + lm_head,
        "language_model.gen_expert": gen_layers + llm.norm_moe_gen.weight.numel(),
        "generation_heads": heads,
        "vit": vit,
        "ema": checkpoint_numel(transformer) + checkpoint_numel(und),
        "vae": checkpoint_numel(c["vae"]),
    }


def memory_estimate(variant: str = "bagel-7b-mot", lora_rank: int | None = 64, dtype_bytes: int = 2,
                    reference: bool = True, expert: str = "gen",
                    components: dict[str, nn.Module] | None = None) -> dict[str, int]:
    """Bytes training holds besides activations, as this plugin and the torch train engine hold them: the weights
    it loads (``weights/transformer``, ``weights/vae``; the understanding parts stay on disk), the trainable
    parameters (``adapters``: LoRA of ``lora_rank`` on ``expert``'s default targets; ``lora_rank=None``: that
    expert's layer weights) with their ``gradients`` and AdamW's two moments, and with full fine-tuning and a KL
    term (``reference``) a frozen copy of the transformer. Everything in the model dtype (``dtype_bytes``)."""
    c = components or full_size_components(variant)
    transformer = c["transformer"]
    counts = {"transformer": checkpoint_numel(transformer), "vae": checkpoint_numel(c["vae"])}
    if lora_rank:
        trainable = lora_numel(transformer, LORA_TARGETS[expert], lora_rank)
    else:
        trainable = sum(p.numel() for n, p in transformer.language_model.named_parameters()
                        if expert == "both" or (expert == "gen") == ("_moe_gen" in n))
    copies = counts["transformer"] if reference and not lora_rank else 0
    return training_bytes(counts, trainable, trainable if lora_rank else 0, copies, dtype_bytes)
