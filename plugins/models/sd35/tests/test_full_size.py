"""SD3.5 Medium and Large at full size on the meta device (``FullSizeSuite``: built in seconds with no storage,
every component's parameter count against its published figure), the released layouts, LoRA and memory counts."""

from __future__ import annotations

import pytest
from omnirl_plugin_sd35 import full_size

from omnirl_core import testing
from omnirl_core.testing.full_size import FullSizeSuite

COMPONENTS = {v: {"transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"} for v in full_size.VARIANTS}


class TestFullSize(FullSizeSuite):
    full_size = full_size
    components = COMPONENTS  # Large in fp32 would be 54 GB

    def test_the_layouts_are_the_released_ones(self, built):
        medium, large = built["medium"][0]["transformer"], built["large"][0]["transformer"]
        assert len(medium.transformer_blocks) == 24 and medium.inner_dim == 1536
        assert [b.attn2 is not None for b in medium.transformer_blocks] == [True] * 13 + [False] * 11  # MMDiT-X
        assert len(large.transformer_blocks) == 38 and large.inner_dim == 2432
        assert all(b.attn2 is None for b in large.transformer_blocks)
        assert medium.pos_embed.pos_embed.shape == (1, 384 * 384, 1536)
        assert built["medium"][0]["text_encoder_2"].config.projection_dim == 1280

    def test_memory_estimate(self, built):
        components = built["medium"][0]
        counts = full_size.parameter_counts("medium", components)
        adapters = 93_978_624  # rank 64 on the default targets of Medium
        lora = full_size.memory_estimate("medium", lora_rank=64, components=components)
        assert lora["adapters"] == 2 * adapters and lora["reference"] == 0
        assert lora["total"] == 2 * sum(counts.values()) + 8 * adapters  # 17.0 GB, 9.5 of them T5
        no_t5 = full_size.memory_estimate("medium", lora_rank=64, use_t5=False, components=components)
        assert "weights/text_encoder_3" not in no_t5 and lora["total"] - no_t5["total"] == 2 * 4_762_310_656
        full = full_size.memory_estimate("medium", lora_rank=None, dtype_bytes=4, components=components)
        # the positional table is held (and copied for the reference) but not trained
        parameters, held = 2_243_171_520, 2_469_663_936
        assert full["gradients"] == 4 * parameters and full["optimizer"] == 8 * parameters
        assert full["reference"] == 4 * held
        assert full["total"] == 4 * sum(counts.values()) + 12 * parameters + 4 * held  # 72.1 GB


@pytest.mark.parametrize("variant", full_size.VARIANTS)
def test_lora_count_is_what_peft_adds(variant: str):
    import torch
    from diffusers import SD3Transformer2DModel
    from omnirl_plugin_sd35.model import SD35Model

    config = {**full_size.TRANSFORMERS[variant], "num_layers": 3}  # full width, three blocks (Medium: two MMDiT-X)
    config["dual_attention_layers"] = config["dual_attention_layers"][:2]
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**config)
    testing.check_lora_numel(transformer, SD35Model.default_lora_targets)
