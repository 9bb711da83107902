"""SD3.5 Medium and Large at full size on the meta device: built in seconds with no storage, and every
component's parameter count against its published figure."""

from __future__ import annotations

import pytest
from omnirl_plugin_sd35.full_size import PUBLISHED, VARIANTS, full_size_components, parameter_counts

from omnirl_core import testing


@pytest.fixture(scope="module")
def built():
    return testing.build_on_meta(full_size_components, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_size_is_built_on_meta_in_seconds_without_memory(built, variant: str):
    assert set(built[variant][0]) == {"transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"}
    testing.check_on_meta(*built[variant])  # Large in fp32 would be 54 GB


def test_the_layouts_are_the_released_ones(built):
    medium, large = built["medium"][0]["transformer"], built["large"][0]["transformer"]
    assert len(medium.transformer_blocks) == 24 and medium.inner_dim == 1536
    assert [b.attn2 is not None for b in medium.transformer_blocks] == [True] * 13 + [False] * 11  # MMDiT-X
    assert len(large.transformer_blocks) == 38 and large.inner_dim == 2432
    assert all(b.attn2 is None for b in large.transformer_blocks)
    assert medium.pos_embed.pos_embed.shape == (1, 384 * 384, 1536)
    assert built["medium"][0]["text_encoder_2"].config.projection_dim == 1280


@pytest.mark.parametrize(("variant", "component"), list(PUBLISHED))
def test_parameter_count_matches_the_published_figure(built, variant: str, component: str):
    testing.check_matches_published(parameter_counts(variant, built[variant][0])[component],
                                    PUBLISHED[variant, component], f"{variant} {component}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_count_is_what_peft_adds(variant: str):
    import torch
    from diffusers import SD3Transformer2DModel
    from omnirl_plugin_sd35.full_size import TRANSFORMERS
    from omnirl_plugin_sd35.model import SD35Model

    config = {**TRANSFORMERS[variant], "num_layers": 3}  # full width, three blocks (Medium: two MMDiT-X blocks)
    config["dual_attention_layers"] = config["dual_attention_layers"][:2]
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**config)
    testing.check_lora_numel(transformer, SD35Model.default_lora_targets)


def test_memory_estimate(built):
    from omnirl_plugin_sd35.full_size import memory_estimate

    components = built["medium"][0]
    counts = parameter_counts("medium", components)
    adapters = 93_978_624  # rank 64 on the default targets of Medium
    lora = memory_estimate("medium", lora_rank=64, components=components)
    assert lora["adapters"] == 2 * adapters and lora["reference"] == 0
    assert lora["total"] == 2 * sum(counts.values()) + 8 * adapters  # 17.0 GB, 9.5 of them T5
    no_t5 = memory_estimate("medium", lora_rank=64, use_t5=False, components=components)
    assert "weights/text_encoder_3" not in no_t5 and lora["total"] - no_t5["total"] == 2 * 4_762_310_656
    full = memory_estimate("medium", lora_rank=None, dtype_bytes=4, components=components)
    # the positional table is held (and copied for the reference) but not trained
    parameters, held = 2_243_171_520, 2_469_663_936
    assert full["gradients"] == 4 * parameters and full["optimizer"] == 8 * parameters
    assert full["reference"] == 4 * held
    assert full["total"] == 4 * sum(counts.values()) + 12 * parameters + 4 * held  # 72.1 GB
