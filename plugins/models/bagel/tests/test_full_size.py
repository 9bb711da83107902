"""BAGEL-7B-MoT at full size on the meta device: built in seconds with no storage, the released parameter names,
and every part's parameter count against its published figure."""

from __future__ import annotations

import pytest
import torch
from omnirl_plugin_bagel.full_size import PUBLISHED, full_size_components, memory_estimate, parameter_counts

from omnirl_core import testing


@pytest.fixture(scope="module")
def built():
    return testing.build_on_meta(full_size_components)


def test_full_size_is_built_on_meta_without_memory(built):
    testing.check_on_meta(*built, max_seconds=60)  # 14.6B fp32 parameters would be 58 GB


def test_the_architecture_and_names_are_the_released_ones(built):
    state = built[0]["transformer"].state_dict()
    assert state["language_model.model.layers.27.self_attn.k_proj_moe_gen.weight"].shape == (512, 3584)
    assert state["language_model.model.layers.0.mlp_moe_gen.down_proj.weight"].shape == (3584, 18944)
    assert state["language_model.model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert state["latent_pos_embed.pos_embed"].shape == (4096, 3584)
    assert state["time_embedder.mlp.0.weight"].shape == (3584, 256) and state["vae2llm.weight"].shape == (3584, 64)
    und = built[0]["understanding"].state_dict()
    assert und["vit_model.embeddings.patch_embedding.weight"].shape == (1152, 3, 14, 14)
    assert und["vit_pos_embed"].shape == (4900, 3584)


@pytest.mark.parametrize("part", [p for _, p in PUBLISHED])
def test_parameter_count_matches_the_published_figure(built, part: str):
    testing.check_matches_published(parameter_counts(components=built[0])[part], PUBLISHED["bagel-7b-mot", part], part)


def test_exact_counts(built):
    counts = parameter_counts(components=built[0])
    assert counts["language_model"] == 14_141_252_608
    assert counts["vae"] == 83_819_683  # the FLUX autoencoder
    assert counts["ema"] == counts["language_model"] + counts["generation_heads"] + counts["vit"] + 16_980_992 + 17_561_600  # + connector + ViT table


def test_lora_count_is_what_peft_adds():
    from omnirl_plugin_bagel.config import BagelConfig
    from omnirl_plugin_bagel.full_size import LLM
    from omnirl_plugin_bagel.model import LORA_TARGETS
    from omnirl_plugin_bagel.transformer import BagelTransformer

    llm = LLM.__class__(**{**LLM.__dict__, "num_hidden_layers": 2})
    with torch.device("meta"):
        net = BagelTransformer(BagelConfig(llm=llm, max_latent_size=4))
    assert testing.check_lora_numel(net, LORA_TARGETS["gen"]) == 2 * 5_767_168 // 8


def test_memory_estimate(built):
    lora = memory_estimate(lora_rank=64, dtype_bytes=2, components=built[0])
    assert lora["adapters"] == 2 * 161_480_704  # rank 64 on the generation expert's 7 projections x 28 layers
    full = memory_estimate(lora_rank=None, dtype_bytes=4, components=built[0])
    gen = parameter_counts(components=built[0])["language_model.gen_expert"]
    assert full["gradients"] == 4 * gen and full["reference"] == full["weights/transformer"]
