"""BAGEL's sizing for the memory planner: the counts of the full-size architecture, the trainable parameters of
LoRA and full fine-tuning, the activation trace on meta against the peak the CPU allocator measures for the real
network, and ``omnirl plan --model bagel`` through the CLI."""

from __future__ import annotations

import pytest
import torch
from omnirl_plugin_bagel.config import BagelConfig, LLMConfig
from omnirl_plugin_bagel.full_size import PUBLISHED, parameter_counts
from omnirl_plugin_bagel.model import LORA_TARGETS, BagelOptions
from omnirl_plugin_bagel.sizing import _components, probe, sizing
from omnirl_plugin_bagel.transformer import BagelTransformer

from omnirl_core.config import RunConfig
from omnirl_core.planning.activations import _prepare, trace_activations
from omnirl_core.planning.measure import training_step_peak_bytes
from omnirl_core.planning.planner import GIB
from omnirl_core.planning.sizing import checkpoint_numel
from omnirl_core.testing.forkserver import run_omnirl


def _config(lora: bool = True, side: int = 512, device: str = "cuda", dtype: str = "bfloat16") -> RunConfig:
    return RunConfig.model_validate({
        "model": {"name": "bagel", "dtype": dtype, "lora": {"enabled": lora, "rank": 64, "alpha": 128}},
        "rollout": {"height": side, "width": side, "guidance_scale": 4.0}, "run": {"device": device}})


def _within_published(count: int, part: str) -> bool:
    published = PUBLISHED["bagel-7b-mot", part]
    return abs(count - published.value) <= max(0.01 * published.value, published.resolution / 2)


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return parameter_counts(components=_components())


def test_components_are_the_full_size_counts(counts):
    s = sizing(_config(), BagelOptions())
    assert s.components == {"transformer": counts["transformer"], "vae": counts["vae"]}
    assert s.trained == ("transformer",) and s.encoders == ("vae",)
    # the transformer is the language model (both experts) without the LM head it does not build, plus the heads
    lm_head = 152064 * 3584
    assert s.components["transformer"] + lm_head == counts["language_model"] + counts["generation_heads"]
    assert _within_published(s.components["transformer"] + lm_head - counts["generation_heads"], "language_model")
    assert s.probe is not None and s.decoder is not None and len(s.notes) >= 3


def test_the_largest_block_is_what_fsdp2_gathers_at_once():
    from omnirl_core.loop.distributed import shard_units  # what the sharded engines wrap one at a time

    transformer = _components()["transformer"]
    blocks = shard_units(transformer, None)
    assert len(blocks) == 28  # the decoder layers, below language_model.model
    assert sizing(_config(), BagelOptions()).largest_block == max(checkpoint_numel(b) for b in blocks)


def test_trainable_parameters_lora_and_full(counts):
    lora = sizing(_config(lora=True), BagelOptions())
    assert lora.lora and lora.trainable == 161_480_704  # r64 on the generation expert's 7 projections x 28 layers
    full = sizing(_config(lora=False), BagelOptions())
    assert not full.lora and full.trainable == counts["language_model.gen_expert"]
    assert _within_published(full.trainable, "language_model.gen_expert")  # the published 6.53B
    und = sizing(_config(lora=False), BagelOptions(train_expert="und"))
    lm_head = 152064 * 3584
    assert und.trainable == counts["language_model.active"] - lm_head  # embeddings, understanding layers, norm
    both = sizing(_config(lora=True), BagelOptions(train_expert="both"))
    assert both.trainable == 2 * lora.trainable


def test_the_prompt_cache_decides_what_runs_through_the_layers():
    cached = sizing(_config(), BagelOptions())
    assert cached.per_sample_bytes == 258 * 28 * 2 * 4 * 128 * 2  # the prompt's keys and values, bf16
    assert "cached keys and values" in cached.notes[0]
    text_trains = sizing(_config(), BagelOptions(train_expert="both"))
    assert text_trains.per_sample_bytes == 0 and "one sequence" in text_trains.notes[0]


# a small BAGEL: the real transformer class, 3 layers of width 64 (4 query, 2 key-value heads)
LLM = LLMConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=192, vocab_size=512)
MAX_LATENT = 16


@pytest.mark.parametrize("side,batch,cached,checkpointing", [
    (128, 2, True, False), (256, 1, True, True), (128, 2, False, True), (192, 4, False, False)])
def test_activation_estimate_matches_the_measured_peak(side: int, batch: int, cached: bool, checkpointing: bool):
    config = _config(side=side, device="cpu", dtype="float32")
    options = BagelOptions(max_prompt_tokens=14, train_expert="gen" if cached else "both")
    targets = LORA_TARGETS[options.train_expert]
    p = probe(config, options, llm=LLM, max_latent_size=MAX_LATENT, targets=targets, cached=cached)
    estimate = trace_activations(p, batch, lora_rank=8, checkpointing=checkpointing)

    torch.manual_seed(0)
    module = _prepare(BagelTransformer(BagelConfig(llm=LLM, max_latent_size=MAX_LATENT)), 8, targets, False).train()
    module.gradient_checkpointing = checkpointing  # the plugin's own switch
    inputs = p.inputs(module, batch)

    measured = training_step_peak_bytes(module, lambda: module(**inputs).float().square().mean())
    print(f"{side}px, batch {batch}, cached {cached}, checkpointing {checkpointing}: estimate "
          f"{estimate.peak / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    assert 0.8 * measured <= estimate.peak <= 1.2 * measured, (estimate.peak, measured)


def test_the_trace_is_of_the_configured_depth_and_routing():
    options = BagelOptions(max_prompt_tokens=14)
    p = probe(_config(side=256, device="cpu", dtype="float32"), options, llm=LLM, max_latent_size=MAX_LATENT,
              targets=LORA_TARGETS["gen"])
    net = p.build(2)
    assert len(p.blocks(net)) == 2 and p.layers == LLM.num_hidden_layers
    assert all(t.is_meta for t in net.parameters())
    out = net(**p.inputs(net, 3))
    assert out.is_meta and out.shape == (3, 256, 64)  # 16 x 16 latent tokens of 2 x 2 x 16 channels


def test_omnirl_plan_prints_a_table_for_bagel():
    args = ["plan", "--model", "bagel", "--algo", "flowgrpo", "--reward", "jpeg", "--device", "cuda",
            "--device-memory", "80GiB", "--set", "model.options.gradient_checkpointing=true",
            "--set", "train.micro_batch_size=2"]
    proc = run_omnirl([*args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "weights/transformer" in out and "weights/vae" in out and "activations" in out
    assert "fits: largest" in out and "SigLIP" in out
    weights = float(next(line for line in out.splitlines() if line.startswith("weights/transformer")).split()[1])
    assert abs(weights - 13_625_167_424 * 2 / GIB) < 0.01  # the transformer's bf16 weights, one device
