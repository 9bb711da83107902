"""FLUX.1's sizing for the memory planner: the counts of the full-size dev and schnell against their published
figures, which variant a run plans (preset, hub id, a local checkpoint's guidance embedding), the tiny preset's own
architecture, the LoRA count, the activation trace on meta against the peak the CPU allocator measures for the real
network, and ``omnirl plan --model flux.1`` through the CLI."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from omnirl_plugin_flux import full_size, tiny
from omnirl_plugin_flux.model import FluxModel, FluxOptions
from omnirl_plugin_flux.sizing import _components, probe, sizing, variant

from omnirl_core import testing
from omnirl_core.config import RunConfig
from omnirl_core.planning.planner import GIB
from omnirl_core.planning.sizing import checkpoint_numel
from omnirl_core.testing.forkserver import run_omnirl


def _config(preset: str | None = None, path: str | None = None, lora: bool = True, side: int = 512,
            device: str = "cuda", dtype: str = "bfloat16") -> RunConfig:
    model: dict[str, Any] = {"name": "flux.1", "dtype": dtype, "lora": {"enabled": lora, "rank": 64, "alpha": 128}}
    if preset:
        model["preset"] = preset
    if path:
        model["path"] = path
    return RunConfig.model_validate({"model": model, "rollout": {"height": side, "width": side},
                                     "run": {"device": device}})


@pytest.mark.parametrize("v", full_size.VARIANTS)
def test_components_are_the_full_size_counts_and_match_the_published_figures(v: str):
    s = sizing(_config(preset=v), FluxOptions())
    assert s.components == full_size.parameter_counts(v, _components(v))
    assert s.trained == ("transformer",) and s.encoders == ("text_encoder", "text_encoder_2", "vae")
    assert s.preset == v and s.lora and s.probe is not None and s.decoder is not None
    for (published_variant, component), published in full_size.PUBLISHED.items():
        if published_variant == v:
            testing.check_matches_published(s.components[component], published, f"FLUX.1-{v} {component}")


def test_dev_and_schnell_differ_in_the_guidance_embedding_only():
    dev, schnell = (sizing(_config(preset=v), FluxOptions()).components for v in full_size.VARIANTS)
    embedder = _components("dev")["transformer"].time_text_embed.guidance_embedder
    assert dev["transformer"] - schnell["transformer"] == checkpoint_numel(embedder) > 0
    assert {k: n for k, n in dev.items() if k != "transformer"} == {
        k: n for k, n in schnell.items() if k != "transformer"}


def test_the_variant_follows_the_preset_the_hub_id_or_the_local_checkpoint(tmp_path):
    options = FluxOptions()
    assert variant(_config(), options) == "dev"  # default_path: FLUX.1-dev
    assert variant(_config(preset="schnell"), options) == "schnell"
    assert variant(_config(path="black-forest-labs/FLUX.1-schnell"), options) == "schnell"
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"guidance_embeds": False}))
    assert variant(_config(path=str(tmp_path)), options) == "schnell"
    assert sizing(_config(path=str(tmp_path)), options).components["transformer"] == \
        full_size.parameter_counts("schnell", _components("schnell"))["transformer"]
    assert variant(_config(preset="tiny"), FluxOptions(tiny_variant="schnell")) == "schnell"
    assert sizing(_config(), options).preset is None  # no preset: the released model the default path names
    # a released preset describes its hub checkpoint; with model.path another checkpoint loads
    assert sizing(_config(preset="schnell", path=str(tmp_path)), options).preset is None


def test_trainable_parameters_lora_and_full():
    lora = sizing(_config(lora=True), FluxOptions())
    with torch.device("meta"):  # full width, one double and two single blocks: peft on meta is quick at this depth
        from diffusers import FluxTransformer2DModel

        unit = FluxTransformer2DModel(**{**full_size.TRANSFORMER, "num_layers": 1, "num_single_layers": 2})
    per_unit = testing.check_lora_numel(unit, FluxModel.default_lora_targets, rank=64)
    assert lora.trainable == 19 * per_unit  # the adapters sit in the blocks only: 19 units of 1 double + 2 single
    full = sizing(_config(lora=False), FluxOptions())
    assert not full.lora and full.trainable == full.components["transformer"]


def test_the_largest_block_is_a_double_stream_block():
    transformer = _components("dev")["transformer"]
    s = sizing(_config(), FluxOptions())
    assert s.largest_block == checkpoint_numel(transformer.transformer_blocks[0])
    assert s.largest_block > checkpoint_numel(transformer.single_transformer_blocks[0])


def test_the_tiny_preset_is_planned_as_the_tiny_architecture():
    from omnirl_plugin_flux.sizing import TINY_CLIP_VOCAB

    from omnirl_core import presets

    assert TINY_CLIP_VOCAB == len(presets.clip_tokenizer())
    for v in tiny.VARIANTS:
        s = sizing(_config(preset="tiny", side=32, device="cpu", dtype="float32"), FluxOptions(tiny_variant=v))
        pipeline = tiny.build_tiny_pipeline(v)
        assert s.preset == "tiny"
        assert s.components == {name: checkpoint_numel(getattr(pipeline, name)) for name in s.components}
        assert set(s.components) == {"transformer", "vae", "text_encoder", "text_encoder_2"}


def test_the_trace_is_of_the_configured_depth_and_inputs():
    p = probe(_config(side=512), FluxOptions(max_sequence_length=128))
    net = p.build(2)
    assert p.layers == 19 and len(net.transformer_blocks) == 2 and len(net.single_transformer_blocks) == 4
    assert len(p.blocks(net)) == 6 and all(t.is_meta for t in net.parameters())
    inputs = p.inputs(net, 3)
    assert inputs["hidden_states"].shape == (3, 32 * 32, 64)  # 512 / 8 / 2: 2x2 patches of 16 channels
    assert inputs["encoder_hidden_states"].shape == (3, 128, 4096) and inputs["txt_ids"].shape == (128, 3)
    assert inputs["guidance"].shape == (3,)
    out = net(**inputs)[0]
    assert out.is_meta and out.shape == (3, 1024, 64)
    schnell = probe(_config(preset="schnell"), FluxOptions())
    assert schnell.inputs(schnell.build(1), 1)["guidance"] is None
    tiny_probe = probe(_config(preset="tiny", side=32), FluxOptions(max_sequence_length=16))
    assert tiny_probe.layers == 1 and tiny_probe.inputs(tiny_probe.build(1), 1)["hidden_states"].shape == (1, 16, 16)


# a small FLUX: the real transformer class, 3 double + 6 single blocks of width 128 (4 heads x 32)
SMALL = {"patch_size": 1, "in_channels": 16, "num_layers": 3, "num_single_layers": 6, "attention_head_dim": 32,
         "num_attention_heads": 4, "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (8, 12, 12)}


@pytest.mark.parametrize("side,batch,checkpointing,v", [(128, 2, False, "dev"), (192, 1, True, "schnell"),
                                                        (96, 3, True, "dev")])
def test_activation_estimate_matches_the_measured_peak(side: int, batch: int, checkpointing: bool, v: str):
    from diffusers import FluxTransformer2DModel

    from omnirl_core.planning.activations import _prepare, trace_activations
    from omnirl_core.planning.measure import training_step_peak_bytes

    config = _config(preset="tiny", side=side, device="cpu", dtype="float32")  # the tiny VAE's x4: 16..48 tokens a side
    p = probe(config, FluxOptions(max_sequence_length=24, tiny_variant=v), transformer=SMALL)
    estimate = trace_activations(p, batch, lora_rank=8, checkpointing=checkpointing)

    torch.manual_seed(0)
    module = _prepare(FluxTransformer2DModel(**SMALL, guidance_embeds=v == "dev"), 8, FluxModel.default_lora_targets,
                      False).train()
    if checkpointing:
        module.enable_gradient_checkpointing()  # the plugin's own switch (DiffusersFlowModel.setup_training)
    inputs = {k: torch.randn(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t
              for k, t in p.inputs(module, batch).items()}
    measured = training_step_peak_bytes(module, lambda: module(**inputs)[0].float().square().mean())
    print(f"{side}px, batch {batch}, checkpointing {checkpointing}, {v}: estimate {estimate.peak / 2**20:.2f} MiB, "
          f"measured {measured / 2**20:.2f} MiB")
    assert 0.9 * measured <= estimate.peak <= 1.1 * measured, (estimate.peak, measured)


def _row(out: str, name: str) -> float:
    return float(next(line for line in out.splitlines() if line.startswith(name)).split()[1])


def test_omnirl_plan_prints_the_transformer_weights_and_a_verdict():
    proc = run_omnirl(["plan", "--model", "flux.1", "--algo", "flowgrpo", "--device", "cpu", "--device-memory", "80GiB"],
                      timeout=600)
    out = proc.stdout
    verdict = next(line for line in out.splitlines() if line.startswith(("fits:", "DOES NOT FIT:")))
    # the defaults on the CPU's dtype (float32: 'auto' there) do not fit one 80 GiB device even with the
    # training call cut to one transition (train.micro_batch_size auto); the error names the change that would
    assert verdict.startswith("DOES NOT FIT") and proc.returncode == 2, proc.stderr[-2000:]
    assert "train micro-batch of 1 " in out
    assert "fits with" in proc.stderr and "model.dtype=bfloat16" in proc.stderr
    dtype_bytes = 4 if "(weights float32)" in verdict else 2
    transformer = full_size.parameter_counts("dev", _components("dev"))["transformer"]
    assert abs(_row(out, "weights/transformer") - transformer * dtype_bytes / GIB) < 0.01
    assert "weights/text_encoder_2" in out and "activations (largest phase)" in out
    assert "guidance is embedded" in out and "preset" not in out  # the released dev, not a preset's numbers


def test_omnirl_plan_with_the_tiny_preset_plans_the_tiny_architecture():
    proc = run_omnirl(["plan", "--model", "flux.1", "--algo", "flowgrpo", "--preset", "tiny", "--device", "cpu",
                       "--device-memory", "80GiB", "--format", "json"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["architecture"] == "tiny" and plan["fits"] and plan["dtype"] == "float32"
    counts = {name: checkpoint_numel(m) for name, m in tiny.build_tiny_pipeline("dev").components.items()
              if isinstance(m, torch.nn.Module)}
    rows = plan["groups"][0]["rows"]
    assert {name: rows[f"weights/{name}"] for name in counts} == {name: 4 * n for name, n in counts.items()}
    assert any("the preset 'tiny'" in note for note in plan["notes"])
