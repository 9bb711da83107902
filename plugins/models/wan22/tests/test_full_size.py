"""Wan2.2 A14B and TI2V-5B at full size on the meta device (``FullSizeSuite``: built in seconds with no storage,
every component's parameter count against its published figure), the released widths, LoRA and memory counts."""

from __future__ import annotations

import pytest
from omnirl_plugin_wan22 import full_size

from omnirl_core import testing
from omnirl_core.testing.full_size import FullSizeSuite

COMPONENTS = {"a14b": {"transformer", "transformer_2", "vae", "text_encoder"},
              "ti2v-5b": {"transformer", "vae", "text_encoder"}}


class TestFullSize(FullSizeSuite):
    full_size = full_size
    components = COMPONENTS  # A14B in fp32 would be 137 GB

    def test_a14b_experts_have_the_same_shape_and_the_released_width(self, built):
        components = built["a14b"][0]
        high, low = components["transformer"], components["transformer_2"]
        assert high is not low
        assert [p.shape for p in high.parameters()] == [p.shape for p in low.parameters()]
        assert len(high.blocks) == 40 and high.blocks[0].attn1.to_q.weight.shape == (5120, 5120)
        five_b = built["ti2v-5b"][0]["transformer"]
        assert len(five_b.blocks) == 30 and five_b.blocks[0].ffn.net[0].proj.weight.shape == (14336, 3072)
        assert built["ti2v-5b"][0]["vae"].config.z_dim == 48

    def test_memory_estimate(self, built):
        components = built["a14b"][0]
        counts = full_size.parameter_counts("a14b", components)
        weights = sum(counts.values())  # both experts, the VAE, UMT5-XXL: 28.58 + 28.58 + 0.25 + 11.36 GB in bf16
        per_expert = 306_708_480  # rank 64 on the default targets of one expert
        both = full_size.memory_estimate("a14b", lora_rank=64, components=components)
        assert both["weights/transformer_2"] == 2 * 14_288_491_584 and both["reference"] == 0
        assert both["adapters"] == 2 * 2 * per_expert and both["optimizer"] == 4 * 2 * per_expert
        assert both["total"] == 2 * weights + 8 * 2 * per_expert  # 73.7 GB
        high = full_size.memory_estimate("a14b", lora_rank=64, trained=("transformer",), components=components)
        assert high["adapters"] == 2 * per_expert
        full = full_size.memory_estimate("a14b", lora_rank=None, dtype_bytes=4, components=components)
        experts = 2 * 14_288_491_584
        assert full["total"] == 4 * weights + (4 + 8 + 4) * experts  # 595 GB


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        full_size.full_size_components("a27b")


def test_lora_count_is_what_peft_adds():
    import torch
    from diffusers import WanTransformer3DModel
    from omnirl_plugin_wan22.model import Wan22Model

    with torch.device("meta"):  # full width, two blocks: peft on meta is quick at this depth
        transformer = WanTransformer3DModel(**{**full_size.TRANSFORMERS["a14b"], "num_layers": 2})
    testing.check_lora_numel(transformer, Wan22Model.default_lora_targets)
