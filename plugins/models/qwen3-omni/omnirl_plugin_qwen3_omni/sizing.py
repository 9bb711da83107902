"""The Qwen3-Omni thinker for the memory planner (``omnirl plan``): parameter counts from the full-size
architecture on ``meta``; activations from the generic transformer estimate (the MoE's routing depends on the
data, which a meta trace does not have), over prompt + completion tokens, plus the float32 logits of the LM head
that the token log-probs need. See omnirl_core.planning."""

from __future__ import annotations

import functools
from typing import Any

import torch

from omnirl_core.planning.model import ModelSizing, lora_settings
from omnirl_core.planning.sizing import checkpoint_numel, trainable_numel
from omnirl_plugin_qwen3_omni.full_size import THINKER, full_size_components

PROMPT_TOKENS = 512
"""Prompt tokens assumed per sequence (text and media placeholders); the completion adds max_new_tokens."""


@functools.lru_cache(maxsize=1)
def _thinker() -> torch.nn.Module:
    return full_size_components()["thinker"]  # meta: no memory to keep


def sizing(config: Any, options: Any) -> ModelSizing:
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniThinker

    thinker = _thinker()
    rank, targets = lora_settings(config, Qwen3OmniThinker.default_lora_targets)
    text = THINKER["text_config"]
    completion = int((config.rollout.options or {}).get("max_new_tokens", 256))
    tokens = PROMPT_TOKENS + completion
    decoder = thinker.model.language_model
    return ModelSizing(
        components={"thinker": checkpoint_numel(thinker)},
        trained=("thinker",),
        trainable=trainable_numel([thinker], targets, rank, skip=(thinker.model.visual, thinker.model.audio_tower)),
        lora=rank is not None,
        hidden=text["hidden_size"],
        layers=text["num_hidden_layers"],
        tokens=tokens,
        per_sample_bytes=tokens * text["vocab_size"] * 4,  # float32 logits for the log-probs
        largest_block=max(checkpoint_numel(b) for b in decoder.layers),
        notes=[(f"activations: generic estimate over {PROMPT_TOKENS} prompt + {completion} completion tokens "
               "per sequence, with float32 logits")],
    )
