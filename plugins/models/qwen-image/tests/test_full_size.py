"""Qwen-Image at full size on the meta device: built in seconds with no storage, and every component's
parameter count against its published figure."""

from __future__ import annotations

import pytest
import torch
from omnirl_plugin_qwen_image.full_size import PUBLISHED, full_size_components, parameter_counts

from omnirl_core import testing


@pytest.fixture(scope="module")
def built():
    return testing.build_on_meta(full_size_components)


def test_full_size_is_built_on_meta_in_seconds_without_memory(built):
    assert set(built[0]) == {"transformer", "vae", "text_encoder"}
    testing.check_on_meta(*built)  # 28.8 billion fp32 parameters would be 115 GB


def test_the_architecture_is_the_released_one(built):
    components, _, _ = built
    transformer, text_encoder = components["transformer"], components["text_encoder"]
    assert len(transformer.transformer_blocks) == 60 and transformer.inner_dim == 3072
    assert text_encoder.config.text_config.num_hidden_layers == 28
    assert text_encoder.model.visual.blocks[0].attn.qkv.weight.shape == (3 * 1280, 1280)
    assert components["vae"].config.z_dim == 16


@pytest.mark.parametrize("component", [c for _, c in PUBLISHED])
def test_parameter_count_matches_the_published_figure(built, component: str):
    testing.check_matches_published(parameter_counts(components=built[0])[component], PUBLISHED["qwen-image", component],
                                    component)


def test_counts_hold_each_tensor_once_and_persistent_buffers():
    from omnirl_core.planning.sizing import checkpoint_numel

    with torch.device("meta"):
        tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    tied.register_buffer("table", torch.zeros(3, device="meta"))
    tied.register_buffer("cache", torch.zeros(5, device="meta"), persistent=False)
    assert checkpoint_numel(tied) == 40 + 3


def test_lora_count_is_what_peft_adds():
    from diffusers import QwenImageTransformer2DModel
    from omnirl_plugin_qwen_image.full_size import TRANSFORMER
    from omnirl_plugin_qwen_image.model import QwenImageModel

    with torch.device("meta"):  # full width, two blocks: peft on meta is quick at this depth
        transformer = QwenImageTransformer2DModel(**{**TRANSFORMER, "num_layers": 2})
    testing.check_lora_numel(transformer, QwenImageModel.default_lora_targets)


def test_memory_estimate(built):
    from omnirl_plugin_qwen_image.full_size import memory_estimate

    counts = parameter_counts(components=built[0])
    lora = memory_estimate(lora_rank=64, dtype_bytes=2, components=built[0])
    assert lora["weights/transformer"] == 2 * 20_430_401_088 and lora["weights/text_encoder"] == 2 * 8_292_166_656
    adapters = 424_673_280  # rank 64 on the default targets, as peft adds them (counted once with peft on meta)
    assert (lora["adapters"], lora["gradients"], lora["optimizer"], lora["reference"]) == (
        2 * adapters, 2 * adapters, 4 * adapters, 0)
    weights = sum(counts[c] for c in ("transformer", "vae", "text_encoder"))
    assert lora["total"] == 2 * weights + 8 * adapters  # 61.1 GB
    full = memory_estimate(lora_rank=None, dtype_bytes=4, components=built[0])
    transformer = counts["transformer"]
    assert full["adapters"] == 0 and full["reference"] == 4 * transformer
    assert full["total"] == 4 * weights + (4 + 8 + 4) * transformer  # 442 GB: fp32 AdamW on 20B does not fit one GPU
    assert memory_estimate(lora_rank=None, reference=False, components=built[0])["reference"] == 0
