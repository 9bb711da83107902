"""The ``tiny`` preset: the Qwen3-Omni thinker architecture (MoE text decoder, vision and audio encoders) with
random weights and the real Qwen tokenizer (Qwen3-Omni's special tokens at their released ids), built locally
in seconds and saved in the transformers layout, so that it loads back through ``from_pretrained`` like a
released checkpoint (config.json + safetensors, tokenizer with its chat template, preprocessor_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_VERSION = 3  # bump when the tiny architecture changes (invalidates the on-disk cache)

# Qwen3-Omni's special tokens after Qwen3's, in id order from 151669 (<|audio_pad|> = 151675)
QWEN3_OMNI_EXTRA_SPECIALS = [
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
    "<|audio_pad|>",
]
VOCAB_SIZE = 152064  # the released thinker's embedding rows (the tokenizer has 151676 tokens)

def tiny_tokenizer() -> Any:
    from omnirl_core.presets import qwen3_tokenizer

    return qwen3_tokenizer(extra_specials=QWEN3_OMNI_EXTRA_SPECIALS, name="qwen3-omni")


def _mrope_section(head_dim: int) -> list[int]:
    """Rotary frequencies per (time, height, width) axis, summing to half the head: the released split
    (24, 20, 20 of 64) scaled; the preset's 8-wide heads keep (1, 1, 2)."""
    if head_dim == 8:
        return [1, 1, 2]
    half = head_dim // 2
    return [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]


def tiny_config(ids: dict[str, int] | None = None, head_dim: int = 8) -> Any:
    """The preset's ``Qwen3OmniMoeThinkerConfig``; ``ids``: the tokenizer's special token ids by role (None: the
    config's defaults, for a build that only counts parameters, as the memory planner's on ``meta``)."""
    from transformers import Qwen3OmniMoeThinkerConfig

    text_ids, media_ids = {}, {}
    if ids is not None:
        text_ids = {"pad_token_id": ids["pad"], "eos_token_id": ids["eos"], "bos_token_id": ids["pad"]}
        media_ids = {"audio_token_id": ids["audio"], "audio_start_token_id": ids["audio_start"],
                     "audio_end_token_id": ids["audio_end"], "image_token_id": ids["image"],
                     "video_token_id": ids["video"], "vision_start_token_id": ids["vision_start"]}
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": VOCAB_SIZE, "tie_word_embeddings": False, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "moe_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
            **text_ids,
            "rope_parameters": {"rope_type": "default", "mrope_section": _mrope_section(head_dim), "interleaved": True,
                                "rope_theta": 1_000_000.0},
        },
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "patch_size": 16,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [1],
                       # as released configs carry it (768 / 16 = 48 per side = sqrt(2304) position embeddings);
                       # vLLM reads it: 128 / 16 = 8 = sqrt(64)
                       "image_size": 128, "apply_vit_abs_pos_embed": True},
        audio_config={"num_mel_bins": 20, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
                      "d_model": 32, "output_dim": 32, "n_window": 50, "n_window_infer": 100, "conv_chunksize": 500,
                      "downsample_hidden_size": 16, "max_source_positions": 1500},
        **media_ids,
    )


def special_ids(tok: Any) -> dict[str, int]:
    """The tokenizer's special token ids by the role ``tiny_config`` reads them under."""
    return dict(zip(["pad", "eos", "image", "video", "vision_start", "audio", "audio_start", "audio_end"],
                    tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>",
                                               "<|vision_start|>", "<|audio_pad|>", "<|audio_start|>",
                                               "<|audio_end|>"])))


def build_tiny(seed: int = 0, head_dim: int = 8) -> tuple[Any, Any, Any, Any]:
    """(thinker, tokenizer, image processor, feature extractor): text decoder hidden 32, 2 layers, 8 experts
    top-2; vision encoder depth 2, patch 16; audio encoder 2 layers, 20 mel bins."""
    from transformers import (
        Qwen2VLImageProcessorPil,
        Qwen3OmniMoeThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    tok = tiny_tokenizer()
    config = tiny_config(special_ids(tok), head_dim)
    torch.manual_seed(seed)
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    _widen_output_head(thinker)
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128})
    feature_extractor = WhisperFeatureExtractor(feature_size=20, sampling_rate=16_000)
    return thinker, tok, image_processor, feature_extractor


def _widen_output_head(thinker: Any, std: float = 0.3) -> None:
    """The released init (std 0.02) over a 32-wide, RMS-normalised hidden state bounds every logit to about
    +-0.6: no policy could become confident, whatever an adapter learns. Rescale the output head (still random
    weights, another init scale) so that logits spread over a few units, as a trained head's do."""
    with torch.no_grad():
        head = thinker.lm_head.weight
        head.mul_(std / head.std())


# the media markup tokens by role, as released checkpoints' tokenizer_config.json names them: transformers'
# Qwen3OmniMoeProcessor (which vLLM builds) reads them off the tokenizer
MEDIA_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}


def _name_media_tokens(path: Path) -> None:
    config = json.loads(path.read_text())
    config["extra_special_tokens"] = {**(config.get("extra_special_tokens") or {}), **MEDIA_TOKENS}
    path.write_text(json.dumps(config, indent=2))


def save_tiny(directory: str | Path, seed: int = 0, head_dim: int = 8) -> Path:
    """Build the tiny preset and save it in the released checkpoints' layout. ``head_dim``: the text decoder's
    attention head size (vLLM's CPU attention takes 64 and up; the preset keeps 8)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    directory = Path(directory)
    thinker, tok, image_processor, feature_extractor = build_tiny(seed, head_dim)
    thinker.save_pretrained(str(directory), safe_serialization=True)
    _save_processors(directory, tok, image_processor, feature_extractor)
    return directory


def _save_processors(directory: Path, tok: Any, image_processor: Any, feature_extractor: Any) -> None:
    tok.save_pretrained(str(directory))
    _name_media_tokens(directory / "tokenizer_config.json")
    # one preprocessor_config.json for both, as released Qwen omni checkpoints ship it
    merged = {**feature_extractor.to_dict(), **image_processor.to_dict()}
    merged.pop("mel_filters", None)  # derived from the other fields
    merged["image_processor_type"] = "Qwen2VLImageProcessor"
    (directory / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))


# -- the whole omni model: thinker, talker (with its code predictor) and code2wav ------------------------------

TINY_OMNI_VERSION = 1  # bump when the tiny talker / code2wav architecture changes
TINY_CODEBOOK = 64  # codes per codebook (released: 2048)
TINY_CODE_GROUPS = 4  # codebooks per frame: the talker's first + the code predictor's residual ones (released: 16)
# the talker's special codec ids sit above the codebook, as in released configs (there: 2048 codes, then specials)
TINY_CODEC_IDS = {"codec_pad_id": TINY_CODEBOOK + 4, "codec_bos_id": TINY_CODEBOOK + 5,
                  "codec_eos_token_id": TINY_CODEBOOK + 6, "codec_nothink_id": TINY_CODEBOOK + 11,
                  "codec_think_bos_id": TINY_CODEBOOK + 12, "codec_think_eos_id": TINY_CODEBOOK + 13}
TINY_SPEAKERS = {"ethan": TINY_CODEBOOK + 20, "chelsie": TINY_CODEBOOK + 21}


def tiny_omni_config(ids: dict[str, int] | None = None) -> Any:
    """The preset's ``Qwen3OmniMoeConfig`` with audio output: the tiny thinker, a talker (MoE decoder, hidden 32,
    2 layers, 4 experts top-2, a 128-entry codec vocabulary), its code predictor (1 layer, 3 residual codebooks of
    64 codes) and a code2wav (1 transformer layer, 4 quantizers, the released upsampling: 1920 samples per frame
    at 24 kHz)."""
    from transformers import Qwen3OmniMoeConfig

    thinker = tiny_config(ids)
    rope = {"rope_type": "default", "mrope_section": _mrope_section(8), "interleaved": True, "rope_theta": 1_000_000.0}
    talker = {
        "text_config": {"vocab_size": 2 * TINY_CODEBOOK, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                        "num_experts_per_tok": 2,
                        "max_position_embeddings": 4096, "rope_parameters": rope},
        "code_predictor_config": {"vocab_size": TINY_CODEBOOK, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 8, "num_code_groups": TINY_CODE_GROUPS,
                                  "max_position_embeddings": 64},
        "num_code_groups": TINY_CODE_GROUPS, "thinker_hidden_size": 32, "accept_hidden_layer": 1,
        "spatial_merge_size": 2,  # released configs carry it; the talker reads it (its config class lacks a default)
        "speaker_id": TINY_SPEAKERS, **TINY_CODEC_IDS,
        **{k: getattr(thinker, k) for k in ("audio_token_id", "image_token_id", "video_token_id",
                                            "vision_start_token_id", "audio_start_token_id")},
    }
    code2wav = {"codebook_size": TINY_CODEBOOK, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                "intermediate_size": 64, "num_hidden_layers": 1, "num_quantizers": TINY_CODE_GROUPS,
                "decoder_dim": 32, "max_position_embeddings": 4096}
    return Qwen3OmniMoeConfig(thinker_config=thinker.to_dict(), talker_config=talker, code2wav_config=code2wav,
                              enable_audio_output=True)


def save_tiny_omni(directory: str | Path, seed: int = 0) -> Path:
    """The tiny preset as a whole omni checkpoint (``Qwen3OmniMoeForConditionalGeneration``, the released layout:
    ``thinker.*``, ``talker.*``, ``code2wav.*``): the thinker of ``save_tiny`` (same seed, same weights), a random
    talker and code2wav, the same tokenizer and preprocessor files."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    directory = Path(directory)
    thinker, tok, image_processor, feature_extractor = build_tiny(seed)
    torch.manual_seed(seed + 1)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config(special_ids(tok))).eval()
    model.thinker.load_state_dict(thinker.state_dict())
    _init_talker_experts(model.talker)
    _widen_codec_heads(model.talker)
    _audible_code2wav(model.code2wav)
    model.save_pretrained(str(directory), safe_serialization=True)
    _save_processors(directory, tok, image_processor, feature_extractor)
    return directory


def _init_talker_experts(talker: Any) -> None:
    """transformers' ``_init_weights`` leaves the talker's fused expert weights as allocated (uninitialised memory:
    values up to 1e28 seen); a released checkpoint overwrites them, a random build must draw them. Same init as the
    thinker's experts."""
    std = talker.config.text_config.initializer_range
    with torch.no_grad():
        for layer in talker.model.layers:
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
                weight.normal_(0.0, std)


def _widen_codec_heads(talker: Any, std: float = 0.3) -> None:
    """As ``_widen_output_head`` for the talker's first-codebook head and the code predictor's residual heads."""
    with torch.no_grad():
        for head in [talker.codec_head, *talker.code_predictor.lm_head]:
            head.weight.mul_(std / head.weight.std())


def _audible_code2wav(code2wav: Any, level: float = 0.003) -> None:
    """The released init (std 0.02 convolutions) shrinks the signal about tenfold in every decoder block: a random
    code2wav outputs about 1e-8, silence to any audio check. Rescale its upsampling and decoder convolutions to unit
    gain (std 1/sqrt(fan-in)) and its last convolution by ``level``, so that random codes decode to a waveform of
    RMS about 0.1-0.25 whose loudness follows the codes (still random weights, another init scale)."""
    with torch.no_grad():
        for module in [*code2wav.upsample.modules(), *code2wav.decoder.modules()]:
            if isinstance(module, torch.nn.Conv1d):
                fan_in = module.weight.shape[1] * module.weight.shape[2]
            elif isinstance(module, torch.nn.ConvTranspose1d):
                fan_in = module.weight.shape[0] * module.weight.shape[2] / module.stride[0]
            else:
                continue
            module.weight.mul_(fan_in ** -0.5 / module.weight.std())
        code2wav.decoder[-1].conv.weight.mul_(level)


def tiny_talker(path: str | Path, dtype: torch.dtype = torch.float32, **options: Any) -> Any:
    """The saved tiny whole model (``save_tiny_omni``) loaded as the plugin loads it, as a talker policy
    (``Qwen3OmniOptions(**options)``, ``train="talker"`` unless given), computing in ``dtype`` (float64 for exact
    checks: torch's grouped expert matmul takes no float64, so the experts then run eagerly)."""
    from omnirl_core.config import ModelSection
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model
    from omnirl_plugin_qwen3_omni.talker import Qwen3OmniTalker

    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(path), dtype="float32"),
                         Qwen3OmniOptions(**{"train": "talker", **options}), "cpu")
    assert isinstance(model, Qwen3OmniTalker)
    if dtype == torch.float64:
        model.module.set_experts_implementation("eager")
    model.module.to(dtype)
    model.dtype = dtype
    return model
