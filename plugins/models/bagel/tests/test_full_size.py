"""BAGEL-7B-MoT at full size on the meta device: built in seconds with no storage, the released parameter names,
and every part's parameter count against its published figure."""

from __future__ import annotations

import resource
import time

import pytest
import torch
from omnirl_plugin_bagel.full_size import PUBLISHED, full_size_components, memory_estimate, parameter_counts


def _matches(count: int, published) -> bool:
    """Within 1 % of the figure, or within the figure's own rounding when that is coarser ("14B")."""
    return abs(count - published.value) <= max(0.01 * published.value, published.resolution / 2)


@pytest.fixture(scope="module")
def built():
    import transformers  # noqa: F401  (imports are not what is measured)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    components = full_size_components()
    return components, time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024


def test_full_size_is_built_on_meta_without_memory(built):
    components, seconds, grown_mib = built
    for name, module in components.items():
        tensors = list(module.parameters()) + list(module.buffers())
        assert tensors and all(t.is_meta for t in tensors), name
    assert seconds < 60, f"building took {seconds:.1f} s"
    assert grown_mib < 512, f"the process grew by {grown_mib:.0f} MiB"  # 14.6B fp32 parameters would be 58 GB


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
    count = parameter_counts(components=built[0])[part]
    published = PUBLISHED["bagel-7b-mot", part]
    assert _matches(count, published), f"{part}: {count:,} vs published {published.value:,.0f} ({published.source})"


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
    from peft import LoraConfig, inject_adapter_in_model

    from omnirl_core.plan.sizing import lora_numel

    llm = LLM.__class__(**{**LLM.__dict__, "num_hidden_layers": 2})
    with torch.device("meta"):
        net = BagelTransformer(BagelConfig(llm=llm, max_latent_size=4))
    expected = lora_numel(net, LORA_TARGETS["gen"], 8)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=list(LORA_TARGETS["gen"])), net)
    assert expected == sum(p.numel() for n, p in net.named_parameters() if "lora_" in n) == 2 * 5_767_168 // 8


def test_memory_estimate(built):
    lora = memory_estimate(lora_rank=64, dtype_bytes=2, components=built[0])
    assert lora["adapters"] == 2 * 161_480_704  # rank 64 on the generation expert's 7 projections x 28 layers
    full = memory_estimate(lora_rank=None, dtype_bytes=4, components=built[0])
    gen = parameter_counts(components=built[0])["language_model.gen_expert"]
    assert full["gradients"] == 4 * gen and full["reference"] == full["weights/transformer"]
