"""The veomni engine on CPU (gloo), in its own environment (``omnirl env build veomni``): 2 ranks make the same
update as the single-process torch engine, to 1e-5 (the fsdp2 tests' criterion, ``_assert_same_update``), for
LoRA and full fine-tuning, with FlowGRPO on the tiny Qwen-Image and GSPO on the tiny Qwen3-Omni thinker (in the
environment's transformers 5.9 layout); its sharded checkpoint loads back on one rank and training continues
exactly.

Both engines run in the veomni environment (same torch / diffusers / transformers), each rank a subprocess of its
interpreter, with the checkpoint's plugin directories on PYTHONPATH (the environment build installs omnirl and
this plugin only)."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omnirl_core.loop.distributed import free_port

pytestmark = [pytest.mark.engines, pytest.mark.slow]

JOB = Path(__file__).with_name("rank_job.py")
PLUGINS = Path(__file__).resolve().parents[3]  # plugins/
PLUGIN_DIRS = ["hardware/cpu", "models/qwen-image", "models/wan22", "algorithms/flowgrpo", "engines/diffusers", "engines/torch",
               "rewards/color", "models/qwen3-omni", "algorithms/gspo", "engines/transformers", "rewards/answer-match"]
LR = {"lora": 1e-2, "full": 1e-3}  # rank_job.py's learning rates


@pytest.fixture(scope="module")
def python() -> str:
    from omnirl_core.serving.envs import component_environment, environment_python
    from omnirl_core.testing import require_engine_environment

    require_engine_environment("veomni", "cpu")
    return str(environment_python(component_environment("veomni", "cpu")))


def _launch(python: str, out: Path, engine: str, lora: bool, world: int = 1, extra: tuple[str, ...] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    path = os.pathsep.join(str(PLUGINS / d) for d in PLUGIN_DIRS)

    def rank(index: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "RANK": str(index), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        if world == 1:
            env.pop("RANK"), env.pop("WORLD_SIZE")
        args = ["--engine", engine, "--lora", str(int(lora)), "--out", str(out), *extra]
        return subprocess.run([python, str(JOB), *args], check=False, env=env, capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=world) as pool:
        for proc in pool.map(rank, range(world)):
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _assert_same_update(ref: dict, got: dict, lr: float, step: int) -> float:
    """fsdp2's criterion: every weight to 1e-5, except at most 0.1 % of ill-conditioned AdamW steps within 1e-2 lr."""
    import torch

    assert ref.keys() == got.keys()
    diffs = torch.cat([(ref[k] - got[k]).abs().flatten() for k in ref])
    off = int((diffs > 1e-5).sum())
    print(f"step {step}: max |veomni - torch| = {float(diffs.max()):.3g}, {off} of {diffs.numel()} over 1e-5")
    assert off <= max(1, 0.001 * diffs.numel()) and float(diffs.max()) < 1e-2 * lr, (step, off, float(diffs.max()))
    return float(diffs.max())


@pytest.fixture(scope="module")
def runs(python: str, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("veomni")
    out = {}
    for mode, lora in (("lora", True), ("full", False)):
        _launch(python, root / mode / "torch", "torch", lora)
        _launch(python, root / mode / "veomni", "veomni", lora, world=2, extra=("--save-shards",))
        out[mode] = root / mode
    return out


def _assert_equal_runs(root: Path, mode: str) -> tuple[dict, dict]:
    """veomni's weights after each of two steps against torch's; the update is real; VeOmni's wrap started from the
    model's own weights (not a fresh init). Returns torch's weights before and after step 1."""
    from safetensors.torch import load_file

    for step in (1, 2):
        ref = load_file(str(root / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(root / "veomni" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR[mode], step)
    init = load_file(str(root / "torch" / "state-0.safetensors"))
    moved = load_file(str(root / "torch" / "state-1.safetensors"))
    assert max(float((init[k] - moved[k]).abs().max()) for k in init) > 100 * 1e-5
    assert all(float((init[k] - v).abs().max()) == 0.0
               for k, v in load_file(str(root / "veomni" / "state-0.safetensors")).items())
    return init, moved


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_veomni_ranks_match_the_single_process_engine(runs: dict, mode: str):

    root = runs[mode]
    _assert_equal_runs(root, mode)
    assert (root / "veomni" / "ckpt" / "shards" / "rank-00001-of-00002.safetensors").is_file()
    expected = "pytorch_lora_weights.safetensors" if mode == "lora" else "transformer/diffusion_pytorch_model.safetensors"
    assert (root / "veomni" / "ckpt" / expected).is_file()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_ulysses_sequence_parallel_ranks_match_the_single_process_engine(python: str, runs: dict, mode: str,
                                                                        tmp_path: Path):
    """VeOmni's sequence-parallel Qwen-Image forward and attention on 3 ranks (the tiny denoiser's 3 heads, one a
    rank; 16 image tokens padded to 18, 6 a rank): each rank sees a slice of every sample's tokens in the update
    (the whole sequence in the rollout, where the ranks' samples may differ), and the weights after two updates equal
    the torch engine's (the all-to-alls and the gathered output's summed backward reorder sums only)."""
    import json

    _launch(python, tmp_path, "veomni", mode == "lora", world=3, extra=("--ulysses", "3"))
    for rank in range(3):
        tokens = json.loads((tmp_path / f"tokens-{rank}.json").read_text())
        assert tokens == {"rollout": [16], "update": [6]}, (rank, tokens)
    from safetensors.torch import load_file

    for step in (1, 2):
        ref = load_file(str(runs[mode] / "torch" / f"state-{step}.safetensors"))
        _assert_same_update(ref, load_file(str(tmp_path / f"state-{step}.safetensors")), LR[mode], step)
    # the gradient's scale too (AdamW's step hides it): a norm 3x off would mean the group's 3 ranks were counted as 3
    # data shards
    ref_m = json.loads((runs[mode] / "torch" / "metrics.json").read_text())
    got_m = json.loads((tmp_path / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        for key in ("grad_norm", "kl"):
            assert got_m[step][key] == pytest.approx(metrics[key], rel=1e-4), (step, key)


@pytest.mark.parametrize(("layout", "world"), [("wan-a14b", 2), ("wan-ti2v-5b", 2), ("wan-a14b", 4)])
def test_ulysses_on_wan22_matches_the_single_process_engine(python: str, layout: str, world: int, tmp_path: Path):
    """Wan2.2 at ulysses 2 (the tiny denoisers' 2 heads): videos of 5 frames are 9 tokens, padded to 10, 5 a rank in
    the update. A14B trains both experts (each split); TI2V-5B's timestep is per token (its modulation is split with
    the tokens), with gradient checkpointing. On 4 ranks: 2 groups of 2, each its own samples (3 and 2 of a
    minibatch's 5), the FSDP mesh over all 4. LoRA weights after two updates, gradient norm and KL against the torch
    engine's."""
    import json

    from safetensors.torch import load_file

    _launch(python, tmp_path / "torch", "torch", True, extra=("--layout", layout))
    _launch(python, tmp_path / "sp", "veomni", True, world=world, extra=("--layout", layout, "--ulysses", "2"))
    for rank in range(world):
        tokens = json.loads((tmp_path / "sp" / f"tokens-{rank}.json").read_text())
        assert tokens == {"rollout": [9], "update": [5]}, (rank, tokens)
    init = load_file(str(tmp_path / "torch" / "state-0.safetensors"))
    for step in (1, 2):
        ref = load_file(str(tmp_path / "torch" / f"state-{step}.safetensors"))
        _assert_same_update(ref, load_file(str(tmp_path / "sp" / f"state-{step}.safetensors")), LR["lora"], step)
    moved = load_file(str(tmp_path / "sp" / "state-1.safetensors"))
    experts = ("transformer.", "transformer_2.") if layout == "wan-a14b" else ("",)
    for expert in experts:  # every trained module learns
        keys = [k for k in init if k.startswith(expert)]
        assert keys and max(float((moved[k] - init[k]).abs().max()) for k in keys) > 1e-3, expert
    ref_m = json.loads((tmp_path / "torch" / "metrics.json").read_text())
    got_m = json.loads((tmp_path / "sp" / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        for key in ("grad_norm", "kl"):
            assert got_m[step][key] == pytest.approx(metrics[key], rel=1e-4), (step, key)


def test_sharded_checkpoint_loads_on_one_rank_and_training_continues(python: str, runs: dict, tmp_path: Path):
    from safetensors.torch import load_file

    two = runs["lora"] / "veomni"
    _launch(python, tmp_path / "one", "veomni", True, extra=("--load-shards", str(two / "ckpt")))
    saved = load_file(str(two / "state-1.safetensors"))
    loaded = load_file(str(tmp_path / "one" / "loaded.safetensors"))
    assert max(float((saved[k] - loaded[k]).abs().max()) for k in saved) == 0.0
    cont = load_file(str(tmp_path / "one" / "state-2.safetensors"))
    _assert_same_update(load_file(str(two / "state-2.safetensors")), cont, LR["lora"], 2)


@pytest.fixture(scope="module")
def thinker_runs(python: str, tmp_path_factory) -> Path:
    """GSPO (beta 0.01) on the tiny Qwen3-Omni thinker: the torch engine and veomni on 2 ranks, LoRA and full
    fine-tuning (fsdp2's thinker runs)."""
    root = tmp_path_factory.mktemp("thinker")
    layout = ("--layout", "qwen3-omni")
    for mode, lora in (("lora", True), ("full", False)):
        _launch(python, root / mode / "torch", "torch", lora, extra=layout)
        _launch(python, root / mode / "veomni", "veomni", lora, world=2,
                extra=(*layout, "--save-shards") if mode == "full" else layout)
    return root


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_gspo_on_the_qwen3_omni_thinker_on_two_veomni_ranks_matches_the_single_process(thinker_runs: Path, mode: str):
    """The thinker in transformers 5.9's flat layout: VeOmni wraps its decoder layers, its towers, its output head
    (a unit of its own: scoring calls it alone) and the root (embeddings, final norm; scoring runs the decoder
    through the root's registered ``omnirl_hidden_states``); the update equals the torch engine's."""
    import json


    root = thinker_runs / mode
    wrap = json.loads((root / "veomni" / "wrap.json").read_text())
    assert wrap["flat"] and wrap["root"], wrap  # the layout this environment's transformers has
    assert "lm_head" in wrap["units"] and "model.layers.0" in wrap["units"], wrap
    assert wrap["head_class"].startswith("FSDPOmnirlUnitLinear"), wrap
    # the head's own class name: no other Linear (projections, LoRA layers) became a unit with it
    assert not any(".self_attn." in u or ".lora_" in u or u.endswith(".fc1") for u in wrap["units"]), wrap
    init, moved = _assert_equal_runs(root, mode)
    # trained weights under the nested layout's names (the project's transformers): weight sync to a rollout worker
    # there, and adapter files, are the same as from any other engine
    prefix = "model.language_model.layers." if mode == "lora" else "model.language_model."
    allowed = (prefix,) if mode == "lora" else (prefix, "lm_head.", "model.audio_tower.", "model.visual.")
    assert all(k.startswith(allowed) for k in init) and any(k.startswith(prefix) for k in init), sorted(init)[:5]
    if mode == "full":  # the output head and the embeddings (units outside the blocks) learn too
        for name in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
            assert float((moved[name] - init[name]).abs().max()) > 1e-4, name
    ref_m = json.loads((root / "torch" / "metrics.json").read_text())
    got_m = json.loads((root / "veomni" / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        for key in ("loss", "kl", "grad_norm"):
            assert got_m[step][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


def test_the_models_gradient_checkpointing_under_veomni_changes_nothing(python: str, thinker_runs: Path,
                                                                      tmp_path: Path):
    """``model.options.gradient_checkpointing`` on the thinker (transformers 5.9's layers, checkpointed in the calls
    that record a graph only: 5.9 would checkpoint the rollout's no-grad generation too, dropping its KV cache), 2
    VeOmni ranks, full fine-tuning: the checkpoint function runs in the update, and the weights after two updates are
    those of the same run without it, bit for bit. (VeOmni's own ``gradient_checkpointing`` option is refused: on
    omnirl's eval-mode policies it would do nothing.)"""
    import json

    from safetensors.torch import load_file

    _launch(python, tmp_path, "veomni", False, world=2, extra=("--layout", "qwen3-omni", "--checkpointing"))
    assert json.loads((tmp_path / "checkpoints.json").read_text()) > 0
    assert json.loads((thinker_runs / "full" / "veomni" / "checkpoints.json").read_text()) == 0
    for step in (1, 2):
        plain = load_file(str(thinker_runs / "full" / "veomni" / f"state-{step}.safetensors"))
        checkpointed = load_file(str(tmp_path / f"state-{step}.safetensors"))
        assert max(float((plain[k] - checkpointed[k]).abs().max()) for k in plain) == 0.0, step


def test_mixed_precision_computes_in_bf16_over_fp32_master_weights(python: str, runs: dict, tmp_path: Path):
    """``mixed_precision: true`` (VeOmni's FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 reduction) on 2 ranks, LoRA:
    the master weights stay float32; the update is bf16's, not fp32's (it differs from the torch engine's by more than
    fp32 rounding), yet points the same way (cosine > 0.95) with a gradient norm within 2 %."""
    import json

    import torch
    from safetensors.torch import load_file

    _launch(python, tmp_path, "veomni", True, world=2, extra=("--options", json.dumps({"mixed_precision": True})))
    init = load_file(str(runs["lora"] / "torch" / "state-0.safetensors"))
    for step in (1, 2):
        fp32 = load_file(str(runs["lora"] / "torch" / f"state-{step}.safetensors"))
        mixed = load_file(str(tmp_path / f"state-{step}.safetensors"))
        assert {v.dtype for v in mixed.values()} == {torch.float32}
        a = torch.cat([(fp32[k] - init[k]).flatten() for k in init])
        b = torch.cat([(mixed[k] - init[k]).flatten() for k in init])
        cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        print(f"step {step}: max |mixed - fp32| {float((a - b).abs().max()):.3g}, update cosine {cosine:.4f}")
        assert float((a - b).abs().max()) > 1e-4 and cosine > 0.95, (step, cosine)
    ref_m = json.loads((runs["lora"] / "torch" / "metrics.json").read_text())
    got_m = json.loads((tmp_path / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        assert got_m[step]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=2e-2), step


def test_thinker_checkpoint_of_two_veomni_ranks_loads_on_one_and_training_continues(python: str, thinker_runs: Path,
                                                                                   tmp_path: Path):
    """Full fine-tuning: the 2-rank checkpoint (shards, and the gathered weights written by ``save_pretrained`` from
    the flat layout) loads on one rank; step 2 there equals step 2 of the uninterrupted run."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    two = thinker_runs / "full" / "veomni"
    with safe_open(str(two / "ckpt" / "model" / "model.safetensors"), "pt") as saved:  # the released names
        keys = set(saved.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "audio_tower.proj1.weight" in keys
    _launch(python, tmp_path / "one", "veomni", False, extra=("--layout", "qwen3-omni", "--load-shards",
                                                              str(two / "ckpt")))
    saved = load_file(str(two / "state-1.safetensors"))
    loaded = load_file(str(tmp_path / "one" / "loaded.safetensors"))
    assert max(float((saved[k] - loaded[k]).abs().max()) for k in saved) == 0.0
    cont = load_file(str(tmp_path / "one" / "state-2.safetensors"))
    _assert_same_update(load_file(str(two / "state-2.safetensors")), cont, LR["full"], 2)
