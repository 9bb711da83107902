"""Wan2.2 A14B and TI2V-5B at full size on the meta device: built in seconds with no storage, and every
component's parameter count against its published figure."""

from __future__ import annotations

import pytest
from omnirl_plugin_wan22.full_size import PUBLISHED, VARIANTS, full_size_components, parameter_counts

from omnirl_core import testing


@pytest.fixture(scope="module")
def built():
    return testing.build_on_meta(full_size_components, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_size_is_built_on_meta_in_seconds_without_memory(built, variant: str):
    expected = {"transformer", "vae", "text_encoder"} | ({"transformer_2"} if variant == "a14b" else set())
    assert set(built[variant][0]) == expected
    testing.check_on_meta(*built[variant])  # A14B in fp32 would be 137 GB


def test_a14b_experts_have_the_same_shape_and_the_released_width(built):
    components = built["a14b"][0]
    high, low = components["transformer"], components["transformer_2"]
    assert high is not low
    assert [p.shape for p in high.parameters()] == [p.shape for p in low.parameters()]
    assert len(high.blocks) == 40 and high.blocks[0].attn1.to_q.weight.shape == (5120, 5120)
    five_b = built["ti2v-5b"][0]["transformer"]
    assert len(five_b.blocks) == 30 and five_b.blocks[0].ffn.net[0].proj.weight.shape == (14336, 3072)
    assert built["ti2v-5b"][0]["vae"].config.z_dim == 48


@pytest.mark.parametrize(("variant", "component"), list(PUBLISHED))
def test_parameter_count_matches_the_published_figure(built, variant: str, component: str):
    testing.check_matches_published(parameter_counts(variant, built[variant][0])[component],
                                    PUBLISHED[variant, component], f"{variant} {component}")


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="expected one of"):
        full_size_components("a27b")


def test_lora_count_is_what_peft_adds():
    import torch
    from diffusers import WanTransformer3DModel
    from omnirl_plugin_wan22.full_size import TRANSFORMERS
    from omnirl_plugin_wan22.model import Wan22Model

    with torch.device("meta"):  # full width, two blocks: peft on meta is quick at this depth
        transformer = WanTransformer3DModel(**{**TRANSFORMERS["a14b"], "num_layers": 2})
    testing.check_lora_numel(transformer, Wan22Model.default_lora_targets)


def test_memory_estimate(built):
    from omnirl_plugin_wan22.full_size import memory_estimate

    components = built["a14b"][0]
    counts = parameter_counts("a14b", components)
    weights = sum(counts.values())  # both experts, the VAE, UMT5-XXL: 28.58 + 28.58 + 0.25 + 11.36 GB in bf16
    per_expert = 306_708_480  # rank 64 on the default targets of one expert
    both = memory_estimate("a14b", lora_rank=64, components=components)
    assert both["weights/transformer_2"] == 2 * 14_288_491_584 and both["reference"] == 0
    assert both["adapters"] == 2 * 2 * per_expert and both["optimizer"] == 4 * 2 * per_expert
    assert both["total"] == 2 * weights + 8 * 2 * per_expert  # 73.7 GB
    high = memory_estimate("a14b", lora_rank=64, trained=("transformer",), components=components)
    assert high["adapters"] == 2 * per_expert
    full = memory_estimate("a14b", lora_rank=None, dtype_bytes=4, components=components)
    experts = 2 * 14_288_491_584
    assert full["total"] == 4 * weights + (4 + 8 + 4) * experts  # 595 GB
