"""The Qwen3-Omni thinker for the memory planner (``omnirl plan``): parameter counts from the architecture on
``meta`` (the released 30B-A3B, or the tiny preset's when the run loads it); activations from the generic
transformer estimate (the MoE's routing depends on the data, which a meta trace does not have), over prompt +
completion tokens, plus the float32 logits of the LM head that the token log-probs need; and what tensor and expert
parallelism split, read off the modules: the MoE experts, and the linear and embedding layers. With
``model.options.train=talker`` (``talker_sizing``) the whole model is loaded and its talker trained. See
omnirl_core.planning."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from omnirl_core.planning.model import ModelSizing, lora_settings
from omnirl_core.planning.sizing import checkpoint_numel, lora_tensor_split_numel, trainable_numel
from omnirl_plugin_qwen3_omni.full_size import full_size_components, full_size_speech

PROMPT_TOKENS = 512
"""Prompt tokens assumed per sequence (text and media placeholders); the completion adds max_new_tokens."""
TINY_PROMPT_TOKENS = 128
"""The same for the tiny preset, whose runs use short text questions (answer-match's built-in ones)."""
TALKER_PROMPT_TOKENS = 128
"""The talker's prefix per sequence: the chat turn's text to speak (a sentence or two) and the codec prefix."""


@functools.lru_cache(maxsize=2)
def _thinker(preset: str | None, head_dim: int) -> torch.nn.Module:
    """The thinker on meta (no memory to keep): the released one, or the tiny preset's."""
    if preset is None:
        return full_size_components()["thinker"]
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from omnirl_plugin_qwen3_omni.tiny import tiny_config

    with torch.device("meta"):
        return Qwen3OmniMoeThinkerForConditionalGeneration(tiny_config(head_dim=head_dim))


def parallel_counts(thinker: torch.nn.Module) -> tuple[int, int, int]:
    """(experts, tensor-split, replicated) parameters of the text decoder and its LM head: those of the MoE experts
    (what expert parallelism splits), those of the linear and embedding layers outside the experts (the column-,
    row- and vocab-parallel layers of tensor parallelism, Shoeybi et al. 2019), and the rest (RMSNorms, the router),
    which every tensor-parallel rank holds whole."""
    decoder = thinker.model.language_model
    experts = sum(p.numel() for name, p in decoder.named_parameters() if ".mlp.experts." in name)
    split = sum(p.numel() for module in (decoder, thinker.lm_head) for m in module.modules()
                if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for p in m.parameters(recurse=False))
    total = sum(p.numel() for module in (decoder, thinker.lm_head) for p in module.parameters())
    return experts, split, total - experts - split


@functools.lru_cache(maxsize=2)
def _omni(tiny: bool) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(thinker, talker, code2wav) of the whole model on meta: the released one, or the tiny preset's."""
    if not tiny:
        speech = full_size_speech()
        return full_size_components()["thinker"], speech["talker"], speech["code2wav"]
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnirl_plugin_qwen3_omni.tiny import tiny_omni_config

    # placeholder special-token ids (the tokenizer's are not needed to count parameters)
    roles = ("pad", "eos", "image", "video", "vision_start", "audio", "audio_start", "audio_end")
    with torch.device("meta"):
        omni = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config({role: i for i, role in enumerate(roles)}))
    return omni.thinker, omni.talker, omni.code2wav


def talker_sizing(config: Any, reply_tokens: int | None = None) -> ModelSizing:
    """``model.options.train=talker``: the whole model held (the thinker frozen: its embeddings give the text the
    talker speaks; code2wav turns frames into sound once per sample, without gradient), the talker trained (LoRA on
    its and its code predictor's attention, or all of it). Activations: the generic estimate of the talker's decoder
    over prefix + frames (``rollout.options.max_new_tokens`` frames); per sample, the float32 logits of every frame's
    codebooks (the first from the talker's codec head, the K - 1 residual ones from the code predictor); the code
    predictor's own layers, run per frame over its K positions, count as more decoder layers. No tensor or expert parallelism (the engines that
    train the talker are data-parallel).

    ``reply_tokens`` (``model.options.train=thinker+talker``): the thinker trained with it (LoRA on its text decoder's
    attention too, or its text decoder whole) over prompt + that many reply tokens; its layers count as more decoder
    layers of the talker's width (as the code predictor's), and its float32 logits over the reply are added."""
    from omnirl_plugin_qwen3_omni.model import TALKER_PRESET
    from omnirl_plugin_qwen3_omni.talker import THINKER_LORA_TARGETS, Qwen3OmniTalker

    preset = config.model.preset if config.model.preset in ("tiny", TALKER_PRESET) else None
    thinker, talker, code2wav = _omni(preset is not None)
    joint = reply_tokens is not None
    default_targets = Qwen3OmniTalker.default_lora_targets
    rank, targets = lora_settings(config, f"{THINKER_LORA_TARGETS}|{default_targets}" if joint else default_targets)
    named = torch.nn.Module()
    named.talker = talker  # the whole model's names (talker.model.layers...), which the LoRA targets match
    if joint:
        named.thinker = thinker
    text = talker.config.text_config
    predictor = talker.config.code_predictor_config
    groups = int(talker.config.num_code_groups)
    frames = int((config.rollout.options or {}).get("max_new_tokens", 256))
    prefix = TINY_PROMPT_TOKENS if preset else TALKER_PROMPT_TOKENS
    logits = frames * (text.vocab_size + (groups - 1) * predictor.vocab_size) * 4
    # the code predictor's layers, run per frame over its K positions, as decoder layers over the sequence's tokens
    # of the talker's width (the generic estimate is linear in layers x tokens x width): what they keep for the
    # backward, and nothing during the rollout (no gradient)
    tokens = prefix + frames
    predictor_layers = math.ceil(predictor.num_hidden_layers * groups * frames * predictor.hidden_size
                                 / (tokens * text.hidden_size))
    thinker_layers, notes = 0, []
    if joint:
        thinker_text = thinker.config.text_config
        thinker_tokens = (TINY_PROMPT_TOKENS if preset else PROMPT_TOKENS) + int(reply_tokens or 0)
        thinker_layers = math.ceil(thinker_text.num_hidden_layers * thinker_tokens * thinker_text.hidden_size
                                   / (tokens * text.hidden_size))
        logits += int(reply_tokens or 0) * thinker_text.vocab_size * 4
        notes.append(f"thinker trained jointly: its {thinker_text.num_hidden_layers} layers over {thinker_tokens} "
                     f"prompt + reply tokens as {thinker_layers} more, with float32 logits over the reply")
    return ModelSizing(
        components={"thinker": checkpoint_numel(thinker), "talker": checkpoint_numel(talker),
                    "code2wav": checkpoint_numel(code2wav)},
        trained=("thinker", "talker") if joint else ("talker",),
        trainable=trainable_numel([named], targets, rank, skip=(thinker.model.visual, thinker.model.audio_tower)),
        lora=rank is not None,
        hidden=text.hidden_size,
        layers=text.num_hidden_layers + predictor_layers + thinker_layers,
        tokens=tokens,
        per_sample_bytes=logits,
        largest_block=max(checkpoint_numel(b) for b in talker.model.layers),
        checkpointable=False,  # the talker refuses gradient_checkpointing (model.py)
        notes=[(f"talker: generic activation estimate over {prefix} prefix + {frames} frames per sequence "
                f"({text.num_hidden_layers} talker layers + the code predictor's as {predictor_layers} more), with "
                f"float32 logits of {groups} codebooks per frame"), *notes],
        preset=preset,
    )


def sizing(config: Any, options: Any) -> ModelSizing:
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniThinker

    train = getattr(options, "train", "thinker")
    if train == "talker":
        return talker_sizing(config)
    if train == "thinker+talker":
        return talker_sizing(config, reply_tokens=int(getattr(options, "reply_max_tokens", 32)))

    preset = config.model.preset if config.model.preset == "tiny" else None
    thinker = _thinker(preset, int(getattr(options, "tiny_head_dim", 8)) if preset else 8)
    rank, targets = lora_settings(config, Qwen3OmniThinker.default_lora_targets)
    text = thinker.config.text_config
    completion = int((config.rollout.options or {}).get("max_new_tokens", 256))
    prompt = TINY_PROMPT_TOKENS if preset else PROMPT_TOKENS
    tokens = prompt + completion
    decoder = thinker.model.language_model
    experts, split, replicated = parallel_counts(thinker)
    # the attention's adapters under tensor parallelism: q/k/v are column-parallel (B split), o row-parallel (A split)
    adapters_split = lora_tensor_split_numel(thinker, targets, rank, ("q_proj", "k_proj", "v_proj"),
                                             ("o_proj",)) if rank else 0
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
        replicated=replicated,
        lora_tensor_split=adapters_split,
        parallel_units={"tensor": (text.num_key_value_heads, "key/value heads"),
                        "expert": (text.num_experts, "experts")},
        notes=[(f"activations: generic estimate over {prompt} prompt + {completion} completion tokens "
               "per sequence, with float32 logits")],
        preset=preset,
    )
