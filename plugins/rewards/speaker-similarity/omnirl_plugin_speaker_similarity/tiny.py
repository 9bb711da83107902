"""A tiny random-weight WavLM x-vector model in the transformers layout, cached under ``$OMNIRL_CACHE/presets``.

``WavLMForXVector`` as microsoft/wavlm-base-plus-sv builds it (7-layer conv feature encoder with group norm and
the released kernels and strides: 320 samples a frame at 16 kHz; gated relative-position transformer; weighted
layer sum; 5 TDNN layers with the released kernels and dilations; statistics pooling; x-vector projection) at
small widths, saved with ``save_pretrained`` (safetensors) beside its ``Wav2Vec2FeatureExtractor`` (16 kHz, no
normalisation, attention masks), so that it loads through the same ``from_pretrained`` path as the real one.
"""

from __future__ import annotations

from pathlib import Path

from omnirl_core.presets import atomic_directory, cache_dir

TINY_VERSION = 1


def save_tiny_wavlm(directory: Path, seed: int = 0) -> None:
    import torch
    from transformers import Wav2Vec2FeatureExtractor, WavLMConfig, WavLMForXVector

    torch.manual_seed(seed)
    config = WavLMConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(32,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2), conv_kernel=(10, 3, 3, 3, 3, 2, 2),
        feat_extract_norm="group", num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        use_weighted_layer_sum=True, tdnn_dim=(32, 32, 32, 32, 64), tdnn_kernel=(5, 3, 3, 1, 1),
        tdnn_dilation=(1, 2, 3, 1, 1), xvector_output_dim=16, num_labels=2,
    )
    WavLMForXVector(config).save_pretrained(str(directory))
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=False,
                             return_attention_mask=True).save_pretrained(str(directory))


def tiny_wavlm_directory(seed: int = 0) -> Path:
    """The cached tiny checkpoint (built on first use)."""
    target = cache_dir() / "presets" / f"speaker-similarity-wavlm-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny_wavlm(tmp, seed))
