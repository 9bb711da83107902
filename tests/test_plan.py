"""The memory planner: its activation estimate (a trace on the meta device) against the peak the CPU allocator
measures for the same network, and the plan's arithmetic and refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnirl_core.config import RunConfig
from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.planning.activations import DenoiserProbe, _prepare, trace_activations
from omnirl_core.planning.measure import training_step_peak_bytes
from omnirl_core.planning.model import ModelSizing
from omnirl_core.planning.planner import GIB, check_fits, parse_bytes, plan_memory

# a small Qwen-Image MMDiT: the real block class, 4 blocks of width 128
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
LAYERS = 4


def _transformer(layers: int, device: str) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    with torch.device(device):
        return QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=layers, attention_head_dim=32,
            num_attention_heads=4, joint_attention_dim=64, guidance_embeds=False, axes_dims_rope=(8, 12, 12))


def _probe(side: int, text: int = 16) -> DenoiserProbe:
    def inputs(module: torch.nn.Module, batch: int) -> dict:
        device = next(module.parameters()).device
        g = torch.Generator().manual_seed(0)
        return {"hidden_states": torch.randn(batch, side * side, 64, generator=g).to(device),
                "timestep": torch.full((batch,), 0.5, device=device),
                "encoder_hidden_states": torch.randn(batch, text, 64, generator=g).to(device),
                "img_shapes": [[(1, side, side)]] * batch, "return_dict": False}

    return DenoiserProbe(build=lambda n: _transformer(n, "meta"), layers=LAYERS,
                         blocks=lambda m: m.transformer_blocks, inputs=inputs, lora_targets=LORA_TARGETS)


@pytest.mark.parametrize("side,batch,checkpointing", [(16, 2, False), (24, 4, False), (32, 2, True), (24, 1, True)])
def test_activation_estimate_matches_the_measured_peak(side: int, batch: int, checkpointing: bool):
    probe = _probe(side)
    estimate = trace_activations(probe, batch, lora_rank=8, checkpointing=checkpointing)
    torch.manual_seed(0)
    module = _prepare(_transformer(LAYERS, "cpu"), 8, LORA_TARGETS, checkpointing).train()
    inputs = probe.inputs(module, batch)

    measured = training_step_peak_bytes(module, lambda: module(**inputs)[0].float().square().mean())
    print(f"{side * 16}px-equivalent tokens {side * side}, batch {batch}, checkpointing {checkpointing}: "
          f"estimate {estimate.peak / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.8 * measured <= estimate.peak <= 1.2 * measured, (estimate.peak, measured)


def test_checkpointing_cuts_the_estimate_as_it_cuts_the_measurement():
    probe = _probe(32)
    plain = trace_activations(probe, 2, 8, False)
    checkpointed = trace_activations(probe, 2, 8, True)
    assert checkpointed.peak < 0.5 * plain.peak
    assert checkpointed.saved < 0.2 * plain.saved


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    with pytest.raises(ConfigError, match="Cannot read the memory size"):
        parse_bytes("eighty")


def _resolved(config: dict, needs_reference: bool = True, needs_ema: bool = False, engine: str = "torch",
              beta: float = 0.04, parallel: dict | None = None, keeps_model: bool = False) -> SimpleNamespace:
    cfg = RunConfig.model_validate(config)

    def dump() -> dict:
        out = cfg.model_dump(mode="json")
        out["algorithm"]["options"] = {"beta": beta}  # the algorithm's own options, as a resolved run dumps them
        return out

    return SimpleNamespace(
        config=cfg, options={"model.options": None, "algorithm.options": SimpleNamespace(beta=beta)},
        algorithm=SimpleNamespace(needs_reference=needs_reference, needs_ema=needs_ema, name="algo", min_group_size=2),
        train_engine=SimpleNamespace(name=engine, shards=engine != "torch", parallel=parallel or {},
                                     keeps_model=keeps_model, trains_lora=True),
        rollout_engine=SimpleNamespace(name="diffusers", batch_option="max_num_seqs"),
        model=SimpleNamespace(name="toy", sizing=None), dump=dump)


SIZING = {"components": {"transformer": 10 * 2**30, "text_encoder": 4 * 2**30, "vae": 2**28},
              "trained": ("transformer",), "encoders": ("text_encoder", "vae"), "hidden": 1024, "layers": 10, "tokens": 1024,
              "largest_block": 2**30}


def test_lora_on_one_device_counts_weights_fp32_adapters_and_activations():
    resolved = _resolved({"model": {"dtype": "bfloat16"}, "train": {"micro_batch_size": 2},
                          "rollout": {"options": {"max_num_seqs": 2}}})
    plan = plan_memory(resolved, 80 * GIB, ModelSizing(trainable=2**27, lora=True, **SIZING))
    [group] = plan.groups
    rows = group.rows
    assert rows["weights/transformer"] == 20 * GIB and rows["weights/text_encoder"] == 8 * GIB
    assert rows["adapters (fp32 master)"] == 0.5 * GIB and rows["gradients"] == 0.5 * GIB
    assert rows["optimizer (AdamW)"] == 1 * GIB
    assert "reference copy" not in rows  # LoRA: the reference is the base model with the adapters off
    # generic estimate: 17 hidden vectors per token and layer, 2 bytes, micro-batch 2
    assert rows["activations (largest phase)"] == 10 * 17 * 1024 * 1024 * 2 * 2
    assert plan.fits and group.total == sum(rows.values())


def test_full_fine_tuning_sharded_over_fsdp2_ranks():
    config = {"model": {"dtype": "bfloat16", "lora": {"enabled": False}, "offload": "cpu"},
              "run": {"executor": "ray", "placement": "split", "train_workers": 4}}
    plan = plan_memory(_resolved(config, engine="fsdp2"), 80 * GIB, ModelSizing(trainable=10 * 2**30, lora=False,
                                                                                 **SIZING))
    actor, rollout = plan.groups
    assert (actor.name, actor.devices, rollout.name) == ("actor", 4, "rollout")
    assert actor.rows["weights/transformer"] == 5 * GIB  # 20 GiB of bf16 over 4 ranks
    assert actor.rows["gradients"] == 5 * GIB and actor.rows["optimizer (AdamW)"] == 10 * GIB
    assert actor.rows["reference copy"] == 20 * GIB  # a KL term in full fine-tuning: the engines do not shard it
    assert actor.rows["fsdp2 gathered blocks"] == 4 * GIB
    assert "weights/text_encoder" not in actor.rows  # offloaded
    assert rollout.rows["weights/transformer"] == 20 * GIB


def test_a_plan_that_does_not_fit_is_refused_with_the_numbers_and_the_fixes():
    resolved = _resolved({"model": {"dtype": "float32"}, "train": {"micro_batch_size": 64}})
    plan = plan_memory(resolved, 80 * GIB, ModelSizing(trainable=2**27, lora=True, **SIZING))
    assert not plan.fits
    assert plan.fixes, plan.table()
    with pytest.raises(ConfigError) as info:
        check_fits(plan, "The run")
    err = info.value
    assert err.exit_code == 2
    text = err.render()
    assert "does not fit in 80 GiB per device" in text and "activations (largest phase)" in text
    assert "fits with" in text



# a MoE decoder: 8 GiB of experts (128 of them), 1 GiB of linear / embedding layers, 2**20 norm and router parameters
MOE = {"components": {"decoder": 8 * GIB + GIB + 2**20}, "trained": ("decoder",), "trainable": 8 * GIB + GIB + 2**20,
       "lora": False, "hidden": 1024, "layers": 8, "tokens": 512, "experts": 8 * GIB, "tensor_split": GIB,
       "parallel_units": {"tensor": (8, "key/value heads"), "expert": (128, "experts")}}
MEGATRON = {"tensor": "tensor_parallel", "expert": "expert_parallel", "data": ""}


def _model_parallel(options: dict, ranks: int = 8, keeps_model: bool = True, device: str = "cuda"):
    config = {"model": {"dtype": "bfloat16", "lora": {"enabled": False}}, "train": {"options": options, "micro_batch_size": 4},
              "run": {"executor": "ray", "placement": "split", "train_workers": ranks, "device": device}}
    resolved = _resolved(config, beta=0.0, engine="megatron", parallel=MEGATRON, keeps_model=keeps_model)
    return plan_memory(resolved, None, ModelSizing(**MOE))


def test_tensor_and_expert_parallel_split_what_the_model_says_they_split():
    plan = _model_parallel({"tensor_parallel": 2, "expert_parallel": 8})
    assert plan.parallel == {"tensor": 2, "expert": 8, "data": 4}
    actor = plan.groups[0].rows
    per_rank = 2**20 + GIB // 2 + 8 * GIB // 8  # norms whole, linear layers / TP, experts / EP
    assert actor["weights (megatron shards)"] == 2 * per_rank and actor["gradients"] == 2 * per_rank
    assert actor["optimizer (AdamW)"] == 4 * per_rank
    # the model's module stays whole, in host memory: the worker does not roll out (split placement), so the engine
    # moves it off the accelerator (TrainEngine.rollout_elsewhere); on a CPU host and device are one memory
    assert "weights/decoder" not in actor and "fsdp2 gathered blocks" not in actor
    table = plan.table()
    assert "parallel degrees of train engine 'megatron' over 8 ranks: tensor 2, expert 8, data 4" in table
    assert f"in host memory ({2 * MOE['trainable'] / GIB:.2f} GiB a rank, not on the device)" in table
    on_cpu = _model_parallel({"tensor_parallel": 2, "expert_parallel": 8}, device="cpu").groups[0].rows
    assert on_cpu["weights/decoder"] == 2 * MOE["trainable"]
    # without expert parallelism the experts split over the tensor-parallel ranks (megatron's expert TP)
    tp_only = _model_parallel({"tensor_parallel": 8, "expert_parallel": 1}).groups[0].rows
    assert tp_only["weights (megatron shards)"] == 2 * (2**20 + GIB // 8 + 8 * GIB // 8)
    # an engine that splits its trained component itself holds only its share of it
    own = _model_parallel({"tensor_parallel": 2, "expert_parallel": 8}, keeps_model=False).groups[0].rows
    assert own["weights/decoder"] == 2 * per_rank and "weights (megatron shards)" not in own


def test_tensor_parallel_splits_most_of_the_activations():
    one = _model_parallel({"tensor_parallel": 1}, keeps_model=False).groups[0].rows["activations (train)"]
    four = _model_parallel({"tensor_parallel": 4}, keeps_model=False).groups[0].rows["activations (train)"]
    # Korthikanti et al. 2022: 34 sbh per layer, 10 + 24/t with tensor parallelism t
    assert one == 8 * 17 * 512 * 1024 * 4 * 2 and four == 8 * 8 * 512 * 1024 * 4 * 2


@pytest.mark.parametrize("options,problem", [
    ({"tensor_parallel": 3}, "train.options.tensor_parallel=3 (tensor parallel) does not divide the 8 train ranks"),
    ({"tensor_parallel": None}, "tensor_parallel=16 (tensor parallel) exceeds the model's 8 key/value heads"),
    ({"tensor_parallel": 1, "expert_parallel": 16}, "expert_parallel=16 (expert parallel) does not divide the 8 train"),
])
def test_a_bad_degree_is_a_usage_error_naming_it(options: dict, problem: str):
    ranks = 16 if options.get("tensor_parallel", 0) is None else 8
    with pytest.raises(UsageError) as info:
        _model_parallel(options, ranks=ranks)
    assert info.value.exit_code == 2
    assert problem.replace("8 train", f"{ranks} train") in info.value.render()


def test_sequence_parallel_splits_the_tokens_and_fsdp_still_shards_over_every_rank():
    def plan(ulysses: int):
        config = {"model": {"dtype": "bfloat16", "lora": {"enabled": False}},
                  "train": {"options": {"ulysses_size": ulysses}, "micro_batch_size": 4},
                  "run": {"executor": "ray", "placement": "split", "train_workers": 4}}
        resolved = _resolved(config, beta=0.0, engine="veomni", parallel={"sequence": "ulysses_size", "data": ""})
        return plan_memory(resolved, None, ModelSizing(**{**MOE, "per_sample_bytes": 2**20}))

    one, two = plan(1), plan(2)
    assert two.parallel == {"sequence": 2, "data": 4}
    rows_one, rows_two = one.groups[0].rows, two.groups[0].rows
    assert rows_two["weights/decoder"] == rows_one["weights/decoder"] == 2 * MOE["trainable"] // 4  # FSDP2
    assert rows_two["activations (train)"] == rows_one["activations (train)"] // 2
