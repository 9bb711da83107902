"""The Qwen3-Omni-30B-A3B thinker at full size on the meta device: built in seconds with no storage, and its
parameter counts (total, per encoder, active per token) against the published figures."""

from __future__ import annotations

import pytest
from omnirl_plugin_qwen3_omni.full_size import PUBLISHED, full_size_components, parameter_counts

from omnirl_core import testing


@pytest.fixture(scope="module")
def built():
    return testing.build_on_meta(full_size_components)


def test_full_size_is_built_on_meta_in_seconds_without_memory(built):
    assert "thinker" in built[0]
    testing.check_on_meta(*built)  # 31.7B fp32 parameters would be 127 GB


def test_the_decoder_is_the_released_moe(built):
    thinker = built[0]["thinker"]
    layers = thinker.model.language_model.layers
    assert len(layers) == 48
    assert layers[0].mlp.experts.down_proj.shape == (128, 2048, 768)  # 128 experts of width 768
    assert thinker.config.text_config.num_experts_per_tok == 8
    assert len(thinker.model.visual.blocks) == 27 and len(thinker.model.audio_tower.layers) == 32


@pytest.mark.parametrize("component", [c for _, c in PUBLISHED])
def test_parameter_count_matches_the_published_figure(built, component: str):
    testing.check_matches_published(parameter_counts(components=built[0])[component], PUBLISHED["30b-a3b", component],
                                    component)


def test_lora_count_is_what_the_plugin_adapts(built):
    """The regex count against peft on a two-layer thinker of full width, with the plugin's own target list."""
    import re

    import torch
    from omnirl_plugin_qwen3_omni.full_size import THINKER
    from omnirl_plugin_qwen3_omni.model import Qwen3OmniThinker
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    from omnirl_core.planning.sizing import lora_numel

    config = {**THINKER, "text_config": {**THINKER["text_config"], "num_hidden_layers": 2}}
    with torch.device("meta"):
        thinker = Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**config))
    pattern = Qwen3OmniThinker.default_lora_targets
    expected = lora_numel(thinker, pattern, 8)
    names = [n for n, m in thinker.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(pattern, n)]
    assert len(names) == 2 * 4  # q, k, v, o of two decoder layers, nothing in the encoders
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=names), thinker)
    assert expected == sum(p.numel() for name, p in thinker.named_parameters() if "lora_" in name) > 0


def test_memory_estimate(built):
    from omnirl_plugin_qwen3_omni.full_size import memory_estimate

    total = 31_719_205_488
    lora = memory_estimate(lora_rank=32, components=built[0])
    adapters = 26_738_688  # rank 32 on q, k, v, o of the 48 decoder layers
    assert lora["weights/thinker"] == 2 * total and lora["adapters"] == 2 * adapters
    assert lora["total"] == 2 * total + 8 * adapters  # 63.7 GB: every expert is held
    full = memory_estimate(lora_rank=None, components=built[0])
    trained = 30_532_646_912  # the decoder and LM head; the vision and audio encoders stay frozen
    assert full["gradients"] == 2 * trained and full["optimizer"] == 4 * trained and full["reference"] == 2 * total
    assert full["total"] == 2 * total + 6 * trained + 2 * total  # 310 GB in bf16
