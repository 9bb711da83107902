"""The Qwen3-Omni thinker for the memory planner (``omnirl plan``): parameter counts from the architecture on
``meta`` (the released 30B-A3B, or the tiny preset's when the run loads it); activations from the generic
transformer estimate (the MoE's routing depends on the data, which a meta trace does not have), over prompt +
completion tokens, plus the float32 logits of the LM head that the token log-probs need; and what tensor and expert
parallelism split, read off the modules: the MoE experts, and the linear and embedding layers. See
omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning.model import ModelSizing, lora_settings
from omnirl_core.planning.sizing import checkpoint_numel, trainable_numel
from omnirl_plugin_qwen3_omni.full_size import full_size_components

PROMPT_TOKENS = 512
"""Prompt tokens assumed per sequence (text and media placeholders); the completion adds max_new_tokens."""
TINY_PROMPT_TOKENS = 128
"""The same for the tiny preset, whose runs use short text questions (answer-match's built-in ones)."""


@functools.lru_cache(maxsize=2)
def _thinker(preset: str | None, head_dim: int) -> torch.nn.Module:
    """The thinker on meta (no memory to keep): the released one, or the tiny preset's."""
    if preset is None:
        return full_size_components()["thinker"]
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from omnirl_plugin_qwen3_omni.tiny import tiny_config

    with torch.device("meta"):
        return Qwen3OmniMoeThinkerForConditionalGeneration(tiny_config(head_dim=head_dim))


def parallel_counts(thinker: torch.nn.Module) -> tuple[int, int]:
    """(experts, tensor-split) parameters of the text decoder and its LM head: those of the MoE experts (what
    expert parallelism splits), and those of the linear and embedding layers outside the experts (the column-,
    row- and vocab-parallel layers of tensor parallelism, Shoeybi et al. 2019); the rest (RMSNorms, the router)
    every tensor-parallel rank holds whole."""
    decoder = thinker.model.language_model
    experts = sum(p.numel() for name, p in decoder.named_parameters() if ".mlp.experts." in name)
    split = sum(p.numel() for module in (decoder, thinker.lm_head) for m in module.modules()
                if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for p in m.parameters(recurse=False))
    return experts, split


def sizing(config: Any, options: Any) -> ModelSizing:
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniThinker

    preset = config.model.preset if config.model.preset == "tiny" else None
    thinker = _thinker(preset, int(getattr(options, "tiny_head_dim", 8)) if preset else 8)
    rank, targets = lora_settings(config, Qwen3OmniThinker.default_lora_targets)
    text = thinker.config.text_config
    completion = int((config.rollout.options or {}).get("max_new_tokens", 256))
    prompt = TINY_PROMPT_TOKENS if preset else PROMPT_TOKENS
    tokens = prompt + completion
    decoder = thinker.model.language_model
    experts, split = parallel_counts(thinker)
    return ModelSizing(
        components={"thinker": checkpoint_numel(thinker)},
        trained=("thinker",),
        trainable=trainable_numel([thinker], targets, rank, skip=(thinker.model.visual, thinker.model.audio_tower)),
        lora=rank is not None,
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        tokens=tokens,
        per_sample_bytes=tokens * text.vocab_size * 4,  # float32 logits for the log-probs
        largest_block=max(checkpoint_numel(b) for b in decoder.layers),
        experts=experts,
        tensor_split=split,
        parallel_units={"tensor": (text.num_key_value_heads, "key/value heads"),
                        "expert": (text.num_experts, "experts")},
        notes=[(f"activations: generic estimate over {prompt} prompt + {completion} completion tokens "
               "per sequence, with float32 logits")],
        preset=preset,
    )
