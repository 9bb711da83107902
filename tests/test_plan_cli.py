"""``omnirl plan`` through the real CLI: the refusal of a run that does not fit (exit 2, the numbers, the changes
that fit) and the README's one-GPU recipe that does."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli


def test_omnirl_plan_refuses_the_default_qwen_image_run_on_one_80gb_gpu_and_names_what_fits():
    proc = run_cli("plan", "--model", "qwen-image", "--algo", "flowgrpo", "--reward", "jpeg", "--device", "cuda",
                   "--device-memory", "80GiB")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "weights/transformer" in proc.stdout and "DOES NOT FIT" in proc.stdout
    assert "does not fit in 80 GiB per device" in proc.stderr
    # train.micro_batch_size auto: one transition per call is the most that would fit; the decode still does not
    assert "train micro-batch of 1 " in proc.stdout
    assert "fits with" in proc.stderr and "model.offload=cpu" in proc.stderr
    fixed = run_cli("plan", "--recipe", "recipes/qwen-image/flowgrpo-lora-1gpu.yaml", "--device-memory", "80GiB",
                    "--format", "json", cwd=Path(__file__).resolve().parents[1])
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    plan = json.loads(fixed.stdout)
    assert plan["fits"] and plan["dtype"] == "bfloat16"
    assert plan["groups"][0]["total"] <= plan["budget"]


# the released Qwen3-Omni thinker (30B-A3B MoE), full fine-tuning, 8 train ranks of 80 GB and a rollout worker
THINKER_8GPU = ("plan", "--model", "qwen3-omni", "--algo", "gspo", "--device", "cuda", "--device-memory", "80GB",
                "--executor", "ray", "--set", "run.placement=split", "--set", "run.train_workers=8", "--set",
                "model.lora.enabled=false", "--set", "rollout.options.max_batch_size=4", "--format", "json")


def test_omnirl_plan_names_the_degrees_and_sets_fsdp2_against_megatron_on_the_moe_thinker():
    fsdp2 = run_cli(*THINKER_8GPU, "--set", "train.engine=fsdp2")
    assert fsdp2.returncode == 0, fsdp2.stderr[-2000:]
    sharded = json.loads(fsdp2.stdout)
    assert sharded["fits"] and sharded["parallel"] == {"data": 8}
    fsdp2_actor, rollout = (g["rows"] for g in sharded["groups"])
    whole = rollout["weights/thinker"]
    assert fsdp2_actor["weights/thinker"] == whole // 8

    megatron = run_cli(*THINKER_8GPU, "--set", "train.engine=megatron", "--set", "train.options.tensor_parallel=4",
                       "--set", "train.options.expert_parallel=8")
    assert megatron.returncode == 0, megatron.stderr[-2000:]
    split = json.loads(megatron.stdout)
    assert split["fits"] and split["parallel"] == {"tensor": 4, "expert": 8, "data": 2}
    actor = split["groups"][0]["rows"]
    # the engine keeps the transformers thinker whole, in host memory (no rollout on these workers)
    assert "weights/thinker" not in actor
    notes = "\n".join(split["notes"])
    assert f"megatron keeps the model's module in host memory ({whole / 2**30:.2f} GiB a rank" in notes
    # experts (most of the decoder) over 8 ranks, attention and embeddings over 4: about fsdp2's eighth
    assert 0.8 * fsdp2_actor["gradients"] < actor["gradients"] < 1.2 * fsdp2_actor["gradients"]
    assert "parallel degrees of train engine 'megatron' over 8 ranks: tensor 4, expert 8, data 2" in notes


def test_a_parallel_degree_that_does_not_fit_the_ranks_or_the_model_is_a_usage_error():
    bad = run_cli(*THINKER_8GPU, "--set", "train.engine=megatron", "--set", "train.options.expert_parallel=3")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "Invalid parallel degrees for train engine 'megatron' over 8 ranks" in bad.stderr
    # tensor_parallel unset: every rank, 8, more than the thinker's 4 key/value heads
    assert "train.options.tensor_parallel=8 (tensor parallel) exceeds the model's 4 key/value heads" in bad.stderr
    assert "train.options.expert_parallel=3 (expert parallel) does not divide the 8 train ranks" in bad.stderr
    assert "does not divide the model's 128 experts" in bad.stderr
    dry = run_cli("train", "--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny", "--set",
                  "train.engine=megatron", "--set", "model.lora.enabled=false", "--set",
                  "train.options.tensor_parallel=2", "--dry-run")
    assert dry.returncode == 2
    assert "train.options.tensor_parallel=2 (tensor parallel) does not divide the 1 train rank" in dry.stderr


def test_a_plan_that_does_not_fit_tries_the_engines_other_degrees():
    proc = run_cli(*THINKER_8GPU[:-2], "--set", "train.engine=megatron", "--set", "train.options.tensor_parallel=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    fixes = [line for line in proc.stderr.splitlines() if "fits with" in line]
    # data parallel 8 holds every weight on every rank; tensor parallel 4 (with a smaller batch) fits
    assert fixes and "--set train.options.tensor_parallel=4" in fixes[0], fixes


def test_the_720p_wan_recipe_needs_sequence_parallelism_and_the_plan_says_so():
    """recipes/wan2.2/flowgrpo-lora-a14b-720p-veomni-8gpu.yaml: one 81-frame 720p sample's training activations do
    not fit an 80 GB device unsplit (fsdp2 splits weights, not tokens: no micro-batch size fits); the veomni
    engine's Ulysses degree 5 does, and a plan at degree 1 names it as the change that fits."""
    repo = Path(__file__).resolve().parents[1]
    recipe = ("plan", "--recipe", "recipes/wan2.2/flowgrpo-lora-a14b-720p-veomni-8gpu.yaml", "--device-memory", "80GB")
    split = run_cli(*recipe, "--format", "json", cwd=repo)
    assert split.returncode == 0, split.stderr[-2000:]
    plan = json.loads(split.stdout)
    assert plan["fits"] and plan["parallel"] == {"sequence": 5, "data": 5}
    whole = run_cli(*recipe, "--set", "train.options.ulysses_size=1", cwd=repo)
    assert whole.returncode == 2 and "DOES NOT FIT" in whole.stdout
    assert "fits with --set train.options.ulysses_size=5" in whole.stderr, whole.stderr[-2000:]
    bad = run_cli(*recipe, "--set", "train.options.ulysses_size=3", cwd=repo)  # 3 divides neither 5 ranks nor 40 heads
    assert bad.returncode == 2 and "40 attention heads" in bad.stderr, bad.stderr[-2000:]
