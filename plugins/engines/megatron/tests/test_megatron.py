"""The megatron engine on CPU (gloo): the core's train-engine contract, and GSPO on the tiny Qwen3-Omni thinker
through the real worker with 2 ranks (tensor parallel, expert parallel, both) against the single-process torch
engine; its sharded checkpoint resumes on the same layout bit for bit and loads on other layouts exactly. LoRA: the
adapters' layout (pure tensors), and one 2-rank test against the torch engine with a bit-for-bit resume.

Every process is a script (``rank_job.py``, ``contract_job.py``): megatron's parallel state is process-global.

The bound: two GSPO steps (2 minibatches each, so 4 AdamW steps at lr 1e-3) from the same samples leave every
weight within 1e-5 = 1e-2 lr of the torch engine's. Megatron computes the same function in another order (fused
QKV, its attention and router kernels, the tensor-parallel partial sums), so the gradients differ in their last
bits, and AdamW's first steps move each weight by about lr x sign(gradient) whatever its size: a gradient
element whose rounding is comparable to itself moves its weight by up to lr. The torch engine against itself with
another micro-batch split (the same sums in another order) differs by 1.7e-6 on this run; the megatron layouts by
1.9e-6 (tensor parallel) to 2.7e-6 (expert parallel), on the same weights (router and experts, which see few
tokens).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnirl_core.loop.distributed import free_port
from omnirl_core.testing.forkserver import run_script

pytestmark = [pytest.mark.engines, pytest.mark.slow]
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install omnirl-plugin-megatron)")

HERE = Path(__file__).parent
LR = 1e-3  # rank_job.py's
BOUND = 1e-2 * LR
LORA_SETTINGS = {"enabled": True, "rank": 4, "alpha": 8.0}  # rank_job.py's --lora
LAYOUTS = {"tp2": {"tensor_parallel": 2}, "ep2": {"tensor_parallel": 1, "expert_parallel": 2},
           "tp2-ep2": {"tensor_parallel": 2, "expert_parallel": 2}}


def _launch(script: str, args: list[str], world: int) -> list[str]:
    port = str(free_port())

    def rank(index: int):
        env = {**os.environ, "RANK": str(index), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        if world == 1:
            env.pop("RANK"), env.pop("WORLD_SIZE")
        return run_script(HERE / script, args, env=env, timeout=900)

    with ThreadPoolExecutor(max_workers=world) as pool:
        procs = list(pool.map(rank, range(world)))
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [proc.stdout for proc in procs]


def _job(out: Path, engine: str, world: int = 1, options: dict | None = None, *extra: str) -> Path:
    _launch("rank_job.py", ["--engine", engine, "--options", json.dumps(options or {}), "--out", str(out), *extra],
            world)
    return out


def _max_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x) if x else 0.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron")
    # GSPO with a KL term (beta 0.01): the reference policy is scored too (megatron: its frozen initial shards)
    out = {"torch": _job(root / "torch", "torch", 1, None, "--beta", "0.01")}
    for name, options in LAYOUTS.items():
        extra = ("--save-shards",) if name == "tp2" else ()
        out[name] = _job(root / name, "megatron", 2, options, "--beta", "0.01", *extra)
    return out


def test_importing_the_plugin_is_cheap():
    import subprocess
    import sys

    code = "import sys, omnirl_plugin_megatron; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_weights_shard_and_gather_back_exactly(tp: int, ep: int):
    """transformers -> megatron shards on every rank of a layout -> whole -> transformers, bit for bit (GQA with
    2 heads per group, 4 experts, a dense layer after a MoE one, and qkv biases)."""
    import torch
    from omnirl_plugin_megatron import thinker

    config = SimpleNamespace(num_hidden_layers=2, hidden_size=16, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=4, intermediate_size=24, moe_intermediate_size=8, num_experts=4,
                             decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False, attention_bias=True)
    g = torch.Generator().manual_seed(0)
    shapes = {"embed_tokens.weight": (32, 16), "norm.weight": (16,)}
    for i in range(2):
        shapes.update({f"layers.{i}.input_layernorm.weight": (16,), f"layers.{i}.post_attention_layernorm.weight": (16,),
                       f"layers.{i}.self_attn.q_proj.weight": (32, 16), f"layers.{i}.self_attn.q_proj.bias": (32,),
                       f"layers.{i}.self_attn.k_proj.weight": (16, 16), f"layers.{i}.self_attn.k_proj.bias": (16,),
                       f"layers.{i}.self_attn.v_proj.weight": (16, 16), f"layers.{i}.self_attn.v_proj.bias": (16,),
                       f"layers.{i}.self_attn.o_proj.weight": (16, 32), f"layers.{i}.self_attn.q_norm.weight": (4,),
                       f"layers.{i}.self_attn.k_norm.weight": (4,)})
    shapes.update({"layers.0.mlp.gate.weight": (4, 16), "layers.0.mlp.experts.gate_up_proj": (4, 16, 16),
                   "layers.0.mlp.experts.down_proj": (4, 16, 8), "layers.1.mlp.gate_proj.weight": (24, 16),
                   "layers.1.mlp.up_proj.weight": (24, 16), "layers.1.mlp.down_proj.weight": (16, 24)})
    hf = {thinker.PREFIX + k: torch.randn(v, generator=g) for k, v in shapes.items()}
    hf["lm_head.weight"] = torch.randn(32, 16, generator=g)
    assert sorted(hf) == sorted(thinker.hf_names(config))
    etp = tp if ep == 1 else 1
    layouts = [thinker.Layout(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r % ep, etp=etp, etp_rank=r % etp)
               for r in range(max(tp, ep))]
    full = thinker.to_megatron(hf, config)
    pieces = [(layout, thinker.shard(full, layout, config.num_experts)) for layout in layouts]
    if tp > 1:  # a split weight is really split
        assert pieces[0][1]["embedding.word_embeddings.weight"].shape == (32 // tp, 16)
    back = thinker.to_hf(thinker.unshard(pieces, config.num_experts), config)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lora_adapters_shard_and_their_fused_qkv_delta_is_peft_s(tp: int):
    """peft's adapters (layer 0: q, k, v, o; layer 1: q, v) -> megatron shards -> whole -> peft, bit for bit; and on
    every rank the interleaved ``linear_qkv`` delta from the local shards is that rank's rows of the fused layout of
    peft's three deltas (8 heads in 4 query groups: several groups per rank at tensor parallel 1 and 2)."""
    import torch
    from omnirl_plugin_megatron import lora, thinker

    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, head_dim=4, hidden_size=16)
    rank, g = 2, torch.Generator().manual_seed(0)
    rows = {"q": 32, "k": 16, "v": 16, "o": 16}
    peft = {}
    for layer, parts in ((0, "qkvo"), (1, "qv")):
        for p in parts:
            name = f"{thinker.PREFIX}layers.{layer}.self_attn.{p}_proj"
            peft[f"{name}.lora_A.weight"] = torch.randn(rank, 32 if p == "o" else 16, generator=g)
            peft[f"{name}.lora_B.weight"] = torch.randn(rows[p], rank, generator=g)
    assert lora.adapted(list(peft)) == {0: ["k", "o", "q", "v"], 1: ["q", "v"]}
    layouts = [thinker.Layout(tp=tp, tp_rank=r) for r in range(tp)]
    full = lora.to_megatron(peft)
    pieces = [(layout, thinker.shard(full, layout, 1)) for layout in layouts]
    back = lora.to_peft(thinker.unshard(pieces, 1))
    assert back.keys() == peft.keys() and all(torch.equal(back[k], peft[k]) for k in peft)
    x = torch.randn(3, 16, generator=g)
    for layer, parts in ((0, "qkv"), (1, "qv")):
        name = f"{thinker.PREFIX}layers.{layer}.self_attn.{{}}_proj.lora_{{}}.weight"
        whole = {p: x @ peft[name.format(p, "A")].T @ peft[name.format(p, "B")].T if p in parts
                 else torch.zeros(3, rows[p]) for p in "qkv"}
        fused = thinker._fuse_qkv(whole["q"].T, whole["k"].T, whole["v"].T, config.num_key_value_heads).T
        for layout, local in pieces:
            key = f"decoder.layers.{layer}.self_attention.linear_qkv.lora_{{}}.{{}}"
            deltas = {p: x @ local[key.format("A", p)].T @ local[key.format("B", p)].T for p in parts}
            assert local[key.format("B", "q")].shape == (32 // tp, rank)  # B is split, A whole
            assert local[key.format("A", "q")].shape == (rank, 16)
            mine = lora.interleave(deltas, {p: rows[p] // tp for p in "qkv"}, 4 // tp)
            assert torch.equal(mine, fused.chunk(tp, dim=1)[layout.tp_rank])
        if layer == 0:  # linear_proj: A split with the input columns, B whole
            assert pieces[-1][1]["decoder.layers.0.self_attention.linear_proj.lora_A.o"].shape == (rank, 32 // tp)
            assert pieces[-1][1]["decoder.layers.0.self_attention.linear_proj.lora_B.o"].shape == (16, rank)


def test_lora_on_other_modules_is_refused_by_name():
    from omnirl_plugin_megatron import lora

    from omnirl_core.errors import UsageError

    with pytest.raises(UsageError) as info:
        lora.adapted(["model.language_model.layers.0.self_attn.q_proj.lora_A.weight", "lm_head.lora_A.weight",
                      "model.audio_tower.layers.0.fc1.lora_B.weight", "lm_head.base_layer.weight"])
    assert "also adapts lm_head, model.audio_tower.layers.0.fc1." in info.value.render()


def _plan(options: dict, ranks: int = 2, lora: bool | dict = False):
    """``omnirl plan``'s numbers for rank_job.py's megatron runs: the tiny thinker, full fine-tuning (or LoRA: True,
    the preset's; a dict, those settings), ``ranks`` train ranks."""
    from omnirl_core.planning.planner import plan_memory
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen3_omni", "omnirl_plugin_gspo",
                          "omnirl_plugin_transformers", "omnirl_plugin_megatron", "omnirl_plugin_answer_match"])
    layer = {"model": {"name": "qwen3-omni", "preset": "tiny", "lora": lora if isinstance(lora, dict) else
                       {"enabled": lora}},
             "algorithm": {"name": "gspo"}, "train": {"engine": "megatron", "options": options},
             "run": {"device": "cpu", "executor": "ray", "placement": "split", "train_workers": ranks}}
    return plan_memory(resolve_run(manager, [layer], probe_device=False), None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_memory_plan_holds_what_each_rank_of_the_engine_holds(runs: dict[str, Path], layout: str):
    """The plan's per-device weights under tensor / expert parallelism are the bytes each of 2 ranks holds (written
    by rank_job.py once the engine is set up): the megatron shards' parameters (gradients and AdamW's moments are
    the same shapes) and the transformers thinker, whole (the rollout's policy and the export target)."""
    held = [json.loads((runs[layout] / f"held-{r}.json").read_text()) for r in range(2)]
    plan = _plan(LAYOUTS[layout])
    tp, ep = LAYOUTS[layout].get("tensor_parallel", 2), LAYOUTS[layout].get("expert_parallel", 1)
    assert plan.architecture == "tiny" and plan.parallel == {"tensor": tp, "expert": ep, "data": 2 // tp}
    assert [(h["layout"]["tp"], h["layout"]["ep"]) for h in held] == [(tp, ep)] * 2
    actor = next(g for g in plan.groups if g.name == "actor")
    print(f"{layout}: planned shards {actor.rows['weights (megatron shards)']} B, thinker "
          f"{actor.rows['weights/thinker']} B; held {[(h['megatron_params'], h['module']) for h in held]}")
    for rank in held:
        # GSPO's KL term scores the reference in megatron (its initial shards, frozen); the transformers copy is freed
        assert rank["reference_shards"] == rank["megatron_params"] and not rank["reference_copy"], rank
        assert actor.rows["weights (megatron shards)"] == rank["megatron_params"]
        assert actor.rows["gradients"] == rank["megatron_params"]
        assert actor.rows["optimizer (AdamW)"] == 2 * rank["megatron_params"]
        assert actor.rows["weights/thinker"] == rank["module"]
    whole = _plan({"tensor_parallel": 1})  # data parallel: every rank holds every trained weight
    assert actor.rows["weights (megatron shards)"] < whole.groups[0].rows["weights (megatron shards)"]
    # with LoRA each rank holds the same base shards, frozen (the norms and routers whole)
    frozen = next(g for g in _plan(LAYOUTS[layout], lora=True).groups if g.name == "actor").rows[
        "weights (megatron frozen base shards)"]
    assert frozen == held[0]["megatron_params"]


def test_the_memory_plan_refuses_a_degree_the_ranks_or_the_model_cannot_take():
    from omnirl_core.errors import UsageError

    with pytest.raises(UsageError) as info:
        _plan({"tensor_parallel": 4, "expert_parallel": 3})
    text = info.value.render()
    assert info.value.exit_code == 2
    assert "train.options.tensor_parallel=4 (tensor parallel) does not divide the 2 train ranks" in text
    assert "tensor_parallel=4 (tensor parallel) exceeds the model's 2 key/value heads" in text
    assert "train.options.expert_parallel=3 (expert parallel) does not divide the 2 train ranks" in text
    assert "expert_parallel=3 (expert parallel) does not divide the model's 8 experts" in text


def test_train_engine_contract_on_one_rank(tmp_path: Path):
    (stdout,) = _launch("contract_job.py", [str(tmp_path)], 1)
    assert "loss " in stdout
    assert (tmp_path / "shards" / "rank-00000-of-00001.safetensors").is_file()
    assert (tmp_path / "model" / "config.json").is_file()  # the transformers layout, for the rollout side


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_the_single_process_engine(runs: dict[str, Path], layout: str):
    torch_run, run = runs["torch"], runs[layout]
    assert _max_diff(torch_run / "state-0.safetensors", run / "state-0.safetensors") == 0.0  # converted exactly
    moved = _max_diff(torch_run / "state-0.safetensors", torch_run / "state-1.safetensors")
    assert moved > 100 * BOUND  # the update is real
    for step in (1, 2):
        diff = _max_diff(torch_run / f"state-{step}.safetensors", run / f"state-{step}.safetensors")
        print(f"{layout} step {step}: max |megatron - torch| = {diff:.3g}")
        assert diff <= BOUND, (layout, step, diff)
    ours, theirs = (json.loads((r / "metrics.json").read_text()) for r in (run, torch_run))
    for step in ("1", "2"):
        assert ours[step]["logprob/abs_delta_max"] < 1e-5  # megatron's scoring = the rollout's log-probs
        assert abs(ours[step]["loss"] - theirs[step]["loss"]) < 1e-5
        # the KL to the reference (megatron's frozen shards vs the torch engine's transformers copy)
        assert theirs[step]["kl"] > 1e-5 and abs(ours[step]["kl"] - theirs[step]["kl"]) < 1e-6, (step, ours[step]["kl"])


def test_gradient_checkpointing_is_megatrons_recompute_and_changes_nothing(runs: dict[str, Path], tmp_path: Path):
    """``model.options.gradient_checkpointing``: megatron's full activation recompute, one layer at a time (on a CPU
    through torch's checkpoint, ``shims``): the same tensor-parallel run, the same weights after two steps."""
    run = _job(tmp_path / "recompute", "megatron", 2, LAYOUTS["tp2"], "--beta", "0.01", "--checkpointing")
    assert json.loads((run / "held-0.json").read_text())["recompute"] == "full"
    assert json.loads((runs["tp2"] / "held-0.json").read_text())["recompute"] is None
    # each of the 2 layers checkpointed in every training forward (none without the option)
    assert json.loads((run / "recomputed-0.json").read_text()) >= 2
    assert json.loads((runs["tp2"] / "recomputed-0.json").read_text()) == 0
    for step in (1, 2):
        diff = _max_diff(runs["tp2"] / f"state-{step}.safetensors", run / f"state-{step}.safetensors")
        print(f"recompute step {step}: max |with - without| = {diff:.3g}")
        assert diff <= BOUND / 10, (step, diff)


def test_checkpoint_resumes_exactly_on_the_same_layout(runs: dict[str, Path], tmp_path: Path):
    saved = runs["tp2"]
    assert {p.name for p in (saved / "ckpt" / "shards").glob("*.safetensors")} == \
        {"rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"}
    assert (saved / "ckpt" / "model" / "config.json").is_file()
    again = _job(tmp_path / "again", "megatron", 2, LAYOUTS["tp2"], "--beta", "0.01", "--load-shards", str(saved / "ckpt"))
    assert _max_diff(saved / "state-1.safetensors", again / "loaded.safetensors") == 0.0
    assert _max_diff(saved / "state-2.safetensors", again / "state-2.safetensors") == 0.0


@pytest.mark.parametrize(("world", "layout"), [(1, {}), (2, LAYOUTS["ep2"])], ids=["one-rank", "expert-parallel"])
def test_checkpoint_loads_on_another_layout(runs: dict[str, Path], tmp_path: Path, world: int, layout: dict):
    saved = runs["tp2"]
    moved = _job(tmp_path / "moved", "megatron", world, layout, "--beta", "0.01", "--load-shards", str(saved / "ckpt"))
    assert _max_diff(saved / "state-1.safetensors", moved / "loaded.safetensors") == 0.0
    assert _max_diff(saved / "state-2.safetensors", moved / "state-2.safetensors") <= BOUND


def test_cli_trains_the_tiny_thinker_and_resumes_bit_for_bit(tmp_path: Path):
    """The real CLI (inline, one rank) with the preset's LoRA (the default; full fine-tuning resumes in
    ``test_checkpoint_resumes_exactly_on_the_same_layout``): 2 steps, and the same run stopped after 1 and resumed
    to 2."""
    from safetensors.torch import load_file

    from omnirl_core.testing import run_train

    args = ("--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny", "--set", "train.engine=megatron",
            "--set", "rollout.prompts_per_step=2", "--set",
            "rollout.group_size=4", "--set", "run.threads=1")
    whole = run_train(tmp_path / "whole", *args, "--steps", "2")
    assert [r["step"] for r in whole] == [1, 2]
    assert whole[0]["logprob/abs_delta_max"] < 1e-5 and whole[0]["grad_norm"] > 0
    run_train(tmp_path / "resumed", *args, "--steps", "1")
    resumed = run_train(tmp_path / "resumed", *args, "--steps", "2")
    assert [(r["loss"], r["grad_norm"], r["reward/mean"]) for r in resumed] == \
        [(r["loss"], r["grad_norm"], r["reward/mean"]) for r in whole]
    last = "checkpoints/step-000002/adapter_model.safetensors"
    a, b = load_file(str(tmp_path / "whole" / last)), load_file(str(tmp_path / "resumed" / last))
    assert a and all(".lora_" in k for k in a)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_lora_on_two_ranks_matches_the_torch_engine_and_resumes_bit_for_bit(tmp_path: Path):
    """GSPO with LoRA (rank_job.py ``--lora``: rank 4, alpha 8 on the attention projections; a KL term to the
    reference, the base model) on 2 ranks against the single-process torch engine, same samples: tensor parallel 2
    (one query group per rank) and expert parallel 2 (tensor parallel 1: both query groups interleaved on each rank;
    the adapters data parallel). The adapters start equal (peft's, seeded by the run), stay within the bound after
    two steps and score as the rollout does; the tensor-parallel checkpoint saved after step 1 holds each rank's
    adapter shards and peft's adapter files, and a fresh pair of ranks loads it and repeats step 2 bit for bit."""
    from safetensors.torch import load_file

    lora = ("--lora", "--beta", "0.04")
    torch_run = _job(tmp_path / "torch", "torch", 1, None, *lora)
    assert _max_diff(torch_run / "state-0.safetensors", torch_run / "state-1.safetensors") > 100 * BOUND
    theirs = json.loads((torch_run / "metrics.json").read_text())
    for layout in ("tp2", "ep2"):
        run = _job(tmp_path / layout, "megatron", 2, LAYOUTS[layout], *lora, *(("--save-shards",) * (layout == "tp2")))
        state = load_file(str(run / "state-0.safetensors"))
        assert state and all(".lora_" in k for k in state)  # the export is the adapters, peft's names
        assert _max_diff(torch_run / "state-0.safetensors", run / "state-0.safetensors") == 0.0
        for step in (1, 2):
            diff = _max_diff(torch_run / f"state-{step}.safetensors", run / f"state-{step}.safetensors")
            print(f"lora {layout} step {step}: max |megatron - torch| adapters = {diff:.3g}")
            assert diff <= BOUND, (layout, step, diff)
        # the plan's adapter shards (q/k/v's B and o's A split over tensor ranks, the rest whole) and frozen base,
        # to the byte of what each rank's megatron model holds
        actor = next(g for g in _plan(LAYOUTS[layout], lora=dict(LORA_SETTINGS)).groups if g.name == "actor").rows
        for rank in range(2):
            held = json.loads((run / f"held-{rank}.json").read_text())
            assert actor["weights (megatron shards)"] + actor["weights (megatron frozen base shards)"] == \
                held["megatron_params"], (layout, rank, actor, held)
        ours = json.loads((run / "metrics.json").read_text())
        for step in ("1", "2"):
            assert ours[step]["logprob/abs_delta_max"] < 1e-5  # the synced adapters: megatron scores as the rollout
            assert abs(ours[step]["loss"] - theirs[step]["loss"]) < 1e-5
            assert abs(ours[step]["kl"] - theirs[step]["kl"]) < 1e-6 and ours[step]["kl"] > 1e-3

    run = tmp_path / "tp2"

    shard = load_file(str(run / "ckpt" / "shards" / "rank-00001-of-00002.safetensors"))
    assert all(".lora_" in k for k in shard) and any(k.startswith("optim/") for k in shard)
    assert shard["param/decoder.layers.0.self_attention.linear_qkv.lora_B.q"].shape == (16, 4)  # 32 q rows / 2
    assert shard["param/decoder.layers.0.self_attention.linear_proj.lora_A.o"].shape == (4, 16)  # 32 columns / 2
    assert (run / "ckpt" / "adapter_model.safetensors").is_file()
    again = _job(tmp_path / "again", "megatron", 2, LAYOUTS["tp2"], *lora, "--load-shards", str(run / "ckpt"))
    assert _max_diff(run / "state-1.safetensors", again / "loaded.safetensors") == 0.0
    assert _max_diff(run / "state-2.safetensors", again / "state-2.safetensors") == 0.0


def test_two_ray_ranks_train_and_a_run_killed_mid_step_resumes_bit_for_bit(tmp_path: Path):
    """The issue's CLI run: `omnirl train --model qwen3-omni --algo gspo --preset tiny --set train.engine=megatron`
    with tensor parallelism over 2 Ray train workers (split placement: the adapters synced to a separate rollout
    worker after each update; the train workers told they do not roll out), GSPO with a KL term (the reference: the
    megatron shards with the adapters off); the driver killed by SIGKILL as step 3 begins, the same command resumes it
    bit for bit (metrics rows, the step-4 adapters)."""
    from omnirl_core.testing import check_killed_run_resumes

    args = ("--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny", "--set", "train.engine=megatron",
            "--set", "algorithm.options.beta=0.01", "--set", "rollout.prompts_per_step=2", "--set",
            "rollout.group_size=4", "--set", "run.threads=1", "--set", "run.save_every=2", "--set",
            "run.sample_every=100", "--executor", "ray", "--set", "run.placement=split", "--set", "run.train_workers=2",
            "--set", "run.worker_cpus=0.5")
    rows = check_killed_run_resumes(tmp_path / "whole", tmp_path / "killed", args, 4, "adapter_model.safetensors")
    assert all(r["logprob/abs_delta_max"] < 1e-5 for r in rows)  # the synced adapters score as megatron's shards
    assert all(r["kl"] >= 0 for r in rows) and any(r["kl"] > 0 for r in rows)
    shards = sorted(p.name for p in (tmp_path / "whole" / "checkpoints" / "step-000004" / "shards").glob("rank-*"))
    assert shards == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
