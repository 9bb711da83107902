"""The released Qwen3-Omni-30B-A3B thinker at full size, built on the ``meta`` device from its published
configuration (``thinker_config`` of Qwen/Qwen3-Omni-30B-A3B-Instruct: the MoE text decoder, the vision encoder,
the AuT audio encoder), with no weights and no memory, to count parameters and plan memory before anything is
downloaded; and, for ``model.options.train=talker``, the whole model's talker (MoE decoder and code predictor) and
code2wav from the same checkpoint's ``talker_config`` and ``code2wav_config``.

A count is the number of elements of the tensors a checkpoint of the module holds (each parameter once, plus
persistent buffers), so that it compares with a published size.
"""

from __future__ import annotations

import torch

from omnirl_core.planning.sizing import (
    check_variant,
    checkpoint_numel,
    pipeline_training_bytes,
    published_counts,
)

VARIANTS = ("30b-a3b",)

# thinker_config of Qwen/Qwen3-Omni-30B-A3B-Instruct config.json (the -Thinking and -Captioner thinkers are the same
# shape)
THINKER = {
    "text_config": {
        "vocab_size": 152064, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True,
                            "rope_theta": 1_000_000.0},
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048, "in_channels": 3,
        "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    },
    "audio_config": {
        "num_mel_bins": 128, "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "downsample_hidden_size": 480, "output_dim": 2048, "max_source_positions": 1500,
        "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500,
    },
    "audio_token_id": 151675, "audio_start_token_id": 151669, "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "position_id_per_seconds": 13, "tie_word_embeddings": False,
}


# talker_config and code2wav_config of the same config.json (the Instruct checkpoint: the one with audio output)
TALKER = {
    "text_config": {
        "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384,
        "shared_expert_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 6, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True,
                            "rope_theta": 1_000_000.0},
    },
    "code_predictor_config": {
        "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "num_code_groups": 16, "thinker_hidden_size": 2048, "accept_hidden_layer": 24, "spatial_merge_size": 2,
    "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148, "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
    "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    "audio_token_id": 151675, "audio_start_token_id": 151669, "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "position_id_per_seconds": 13, "tie_word_embeddings": False,
}
CODE2WAV = {
    "codebook_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_quantizers": 16, "sliding_window": 72,
    "max_position_embeddings": 8000, "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01, "decoder_dim": 1536,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


PUBLISHED = published_counts(__package__)
"""Published parameter counts by (variant, component): ``published.toml`` beside this module."""


def full_size_components(variant: str = "30b-a3b") -> dict[str, torch.nn.Module]:
    """``{"thinker": module}`` on ``meta`` (no storage): seconds, no memory."""
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    check_variant("Qwen3-Omni", variant, VARIANTS)
    with torch.device("meta"):
        return {"thinker": Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**THINKER))}


def active_text_parameters(thinker: torch.nn.Module) -> int:
    """Parameters of the text decoder (LM head included) one token uses: everything but the experts, plus
    ``num_experts_per_tok`` of the ``num_experts`` experts of every MoE layer."""
    config = thinker.config.text_config
    decoder = thinker.model.language_model
    experts = sum(p.numel() for name, p in decoder.named_parameters() if ".mlp.experts." in name)
    total = checkpoint_numel(decoder) + checkpoint_numel(thinker.lm_head)
    return total - experts + experts * config.num_experts_per_tok // config.num_experts


def parameter_counts(variant: str = "30b-a3b", components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Counts of the thinker and of its parts: ``thinker.text`` (the MoE decoder with its LM head),
    ``thinker.text.active`` (what one token uses), ``thinker.visual``, ``thinker.audio_tower``.
    ``components``: those ``full_size_components`` built (built here when None)."""
    thinker = (components or full_size_components(variant))["thinker"]
    return {
        "thinker": checkpoint_numel(thinker),
        "thinker.text": checkpoint_numel(thinker.model.language_model) + checkpoint_numel(thinker.lm_head),
        "thinker.text.active": active_text_parameters(thinker),
        "thinker.visual": checkpoint_numel(thinker.model.visual),
        "thinker.audio_tower": checkpoint_numel(thinker.model.audio_tower),
    }


# -- memory ----------------------------------------------------------------------------------------------------


def memory_estimate(variant: str = "30b-a3b", lora_rank: int | None = 32, dtype_bytes: int = 2, reference: bool = True,
                    components: dict[str, torch.nn.Module] | None = None) -> dict[str, int]:
    """Bytes training holds besides activations, as the torch train engine holds them: the thinker's weights
    (``weights/thinker``); the trainable parameters (``adapters``: LoRA of ``lora_rank`` on the decoder attention,
    the plugin's default targets; ``lora_rank=None``: the thinker but its vision and audio encoders, whose weights
    are already counted) with their ``gradients`` and AdamW's two moment buffers (``optimizer``); with full
    fine-tuning and a KL term (``reference``), a frozen copy of the whole thinker (the policy copies the module).
    Every expert's parameters count: all of them are held, whichever a token uses. Everything in the model dtype
    (``dtype_bytes``: 2 for bfloat16, 4 for float32). ``total`` sums them."""
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniThinker

    c = components or full_size_components(variant)
    thinker = c["thinker"]
    return pipeline_training_bytes(c, ("thinker",), Qwen3OmniThinker.default_lora_targets, lora_rank, dtype_bytes,
                                   reference, skip=(thinker.model.visual, thinker.model.audio_tower))


def full_size_speech(variant: str = "30b-a3b") -> dict[str, torch.nn.Module]:
    """``{"talker": module, "code2wav": module}`` of the released whole model on ``meta`` (no storage)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
        Qwen3OmniMoeTalkerConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
    )

    check_variant("Qwen3-Omni", variant, VARIANTS)
    with torch.device("meta"):
        return {"talker": Qwen3OmniMoeTalkerForConditionalGeneration(Qwen3OmniMoeTalkerConfig(**TALKER)),
                "code2wav": Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**CODE2WAV))}
