"""The Qwen3-Omni-30B-A3B thinker at full size on the meta device: built in seconds with no storage, and its
parameter counts (total, per encoder, active per token) against the published figures; the whole model's talker and
code2wav, and the sizing of model.options.train=talker."""

from __future__ import annotations

from typing import Any

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


def test_what_tensor_and_expert_parallelism_split_is_read_off_the_architecture(built):
    """The planner's split of the full fine-tuning set: the experts (48 layers x 128 experts x [gate; up; down] of
    2048 x 768), the linear and embedding layers (embeddings, LM head, q/k/v/o of 32 query and 4 key/value heads of
    128), and the rest (RMSNorms, the routers), which every tensor-parallel rank holds whole."""
    from types import SimpleNamespace

    from omnirl_plugin_qwen3_omni.sizing import parallel_counts, sizing

    from omnirl_core.config import RunConfig

    experts, split, replicated = parallel_counts(built[0]["thinker"])
    assert experts == 48 * 128 * 3 * 2048 * 768
    assert split == 2 * 152064 * 2048 + 48 * (2 * 4096 * 2048 + 2 * 512 * 2048)
    config = RunConfig.model_validate({"model": {"name": "qwen3-omni", "lora": {"enabled": False}}})
    plan = sizing(config, SimpleNamespace(tiny_head_dim=8))
    rest = plan.trainable - plan.experts - plan.tensor_split
    assert (plan.experts, plan.tensor_split) == (experts, split)
    assert rest == replicated == plan.replicated == 48 * (128 * 2048 + 2 * 128 + 2 * 2048) + 2048  # routers, q/k
    # norms, layer norms, final norm
    # LoRA (rank 8 on q/k/v/o of the 48 layers): tensor parallelism splits q/k/v's B and o's A
    lora = sizing(RunConfig.model_validate({"model": {"name": "qwen3-omni", "lora": {"enabled": True, "rank": 8}}}),
                  SimpleNamespace(tiny_head_dim=8))
    assert lora.lora_tensor_split == 48 * 8 * (4096 + 512 + 512 + 4096)
    assert lora.trainable == 48 * 8 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    assert plan.parallel_units == {"tensor": (4, "key/value heads"), "expert": (128, "experts")}
    assert plan.preset is None


def test_the_tiny_preset_is_planned_from_its_own_architecture():
    from types import SimpleNamespace

    from omnirl_plugin_qwen3_omni.sizing import sizing
    from omnirl_plugin_qwen3_omni.tiny import build_tiny

    from omnirl_core.config import RunConfig
    from omnirl_core.planning.sizing import checkpoint_numel

    config = RunConfig.model_validate({"model": {"name": "qwen3-omni", "preset": "tiny"}})
    plan = sizing(config, SimpleNamespace(tiny_head_dim=8))
    thinker = build_tiny()[0]
    assert plan.preset == "tiny" and plan.components == {"thinker": checkpoint_numel(thinker)}
    assert plan.parallel_units == {"tensor": (2, "key/value heads"), "expert": (8, "experts")}


def test_the_whole_models_talker_and_code2wav_are_built_on_meta_from_the_released_config():
    from omnirl_plugin_qwen3_omni.full_size import full_size_speech

    speech, seconds, grown = testing.build_on_meta(full_size_speech)
    testing.check_on_meta(speech, seconds, grown)
    talker, code2wav = speech["talker"], speech["code2wav"]
    layers = talker.model.layers
    assert len(layers) == 20 and talker.config.text_config.num_experts_per_tok == 6
    assert layers[0].mlp.experts.down_proj.shape == (128, 1024, 384)  # 128 experts of width 384
    assert talker.config.num_code_groups == 16 and len(talker.code_predictor.model.layers) == 5
    assert talker.codec_head.weight.shape == (3072, 1024)
    assert len(talker.code_predictor.lm_head) == 15  # the residual codebooks: 16 - the talker's first
    assert code2wav.config.num_quantizers == 16 and code2wav.config.upsample_rates == [8, 5, 4, 3]


def _talker_config(preset: str | None, rank: int | None) -> Any:
    from omnirl_core.config import RunConfig

    model = {"name": "qwen3-omni", "options": {"train": "talker"},
             "lora": {"enabled": rank is not None, "rank": rank or 8, "alpha": rank or 8}}
    if preset:
        model["preset"] = preset
    return RunConfig.model_validate({"model": model, "rollout": {"options": {"max_new_tokens": 36}}})


def test_train_talker_plans_the_whole_model_with_the_talker_trained():
    """The sizing of model.options.train=talker: the thinker, talker and code2wav held, the talker trained; its LoRA
    count against peft on the tiny whole model (the plugin's own targets), and no gradient checkpointing offered
    (the talker refuses it)."""
    import re
    from types import SimpleNamespace

    import torch
    from omnirl_plugin_qwen3_omni.sizing import sizing
    from omnirl_plugin_qwen3_omni.talker import Qwen3OmniTalker
    from omnirl_plugin_qwen3_omni.tiny import tiny_omni_config
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnirl_core.planning.sizing import checkpoint_numel

    plan = sizing(_talker_config("tiny-talker", 8), SimpleNamespace(train="talker"))
    roles = ("pad", "eos", "image", "video", "vision_start", "audio", "audio_start", "audio_end")
    with torch.device("meta"):
        omni = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config({r: i for i, r in enumerate(roles)}))
    assert plan.preset == "tiny-talker" and plan.trained == ("talker",) and plan.lora
    assert plan.components == {"thinker": checkpoint_numel(omni.thinker), "talker": checkpoint_numel(omni.talker),
                               "code2wav": checkpoint_numel(omni.code2wav)}
    assert not plan.checkpointable
    names = [n for n, m in omni.named_modules()
             if isinstance(m, torch.nn.Linear) and re.fullmatch(Qwen3OmniTalker.default_lora_targets, n)]
    assert names and all(n.startswith("talker.") for n in names)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=names), omni)
    assert plan.trainable == sum(p.numel() for name, p in omni.named_parameters() if "lora_" in name) > 0
    full = sizing(_talker_config("tiny-talker", None), SimpleNamespace(train="talker"))
    assert full.trainable == sum(p.numel() for name, p in omni.talker.named_parameters() if "lora_" not in name)


def test_the_released_talker_run_is_planned_without_offering_checkpointing():
    from types import SimpleNamespace

    from omnirl_plugin_qwen3_omni.sizing import sizing

    from omnirl_core.planning.sizing import checkpoint_numel

    plan = sizing(_talker_config(None, 32), SimpleNamespace(train="talker"))
    assert plan.preset is None and set(plan.components) == {"thinker", "talker", "code2wav"}
    assert plan.components["thinker"] == 31_719_205_488  # as test_memory_estimate's thinker
    assert plan.components["talker"] > 3e9 and plan.tokens == 128 + 36 and not plan.checkpointable
    assert plan.largest_block == max(checkpoint_numel(b) for b in _speech()["talker"].model.layers)


def _speech() -> dict[str, Any]:
    from omnirl_plugin_qwen3_omni.full_size import full_size_speech

    return full_size_speech()


def test_the_thinkers_lora_is_planned_from_its_regex():
    """The token model's default targets are one regex over whole module names; the plan once read them as a tuple of
    characters and planned no adapters at all."""
    from types import SimpleNamespace

    from omnirl_plugin_qwen3_omni.sizing import sizing

    from omnirl_core.config import RunConfig

    config = RunConfig.model_validate({"model": {"name": "qwen3-omni", "lora": {"rank": 32, "alpha": 32}}})
    plan = sizing(config, SimpleNamespace(tiny_head_dim=8))
    assert plan.lora and plan.trainable == 26_738_688  # rank 32 on q, k, v, o of the 48 decoder layers
