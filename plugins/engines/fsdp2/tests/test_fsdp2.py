"""FSDP2 on CPU (gloo): 2 ranks make the same update as the single-process torch engine, to 1e-5 (a few
ill-conditioned AdamW steps to 1e-2 lr: ``_assert_same_update``), for LoRA and full fine-tuning, with FlowGRPO on
the tiny Qwen-Image and GSPO on the tiny Qwen3-Omni thinker; a sharded checkpoint loads back on another number of
ranks and training continues exactly (optimizer state included)."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omnirl_core.loop.distributed import free_port
from omnirl_core.testing.forkserver import run_script

JOB = Path(__file__).with_name("rank_job.py")


def _launch(out: Path, engine: str, lora: bool, world: int = 1, extra: tuple[str, ...] = ()) -> None:
    """``world`` rank processes of ``rank_job.py`` at once (forked by the test fork server: torch is imported)."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())

    def rank(index: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "RANK": str(index), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        if world == 1:
            env.pop("RANK"), env.pop("WORLD_SIZE")
        args = ["--engine", engine, "--lora", str(int(lora)), "--out", str(out), *extra]
        return run_script(JOB, args, env=env, timeout=600)

    with ThreadPoolExecutor(max_workers=world) as pool:
        for proc in pool.map(rank, range(world)):
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


LR = {"lora": 1e-2, "full": 1e-3}  # rank_job.py's learning rates


def _assert_same_update(ref: dict, got: dict, lr: float, step: int) -> None:
    """The two engines' weights after ``step`` agree: every weight to 1e-5, except where a weight's AdamW step is
    ill-conditioned (its two minibatches' gradients nearly cancel, so summation-order rounding moves that step
    by a fraction of lr; which weights depends on the data, e.g. the tiny tokenizer): at most 0.1 % of the
    weights, each within 1e-2 lr."""
    assert ref.keys() == got.keys()
    diffs = torch.cat([(ref[k] - got[k]).abs().flatten() for k in ref])
    off = int((diffs > 1e-5).sum())
    print(f"step {step}: max |fsdp2 - torch| = {float(diffs.max()):.3g}, {off} of {diffs.numel()} over 1e-5")
    assert off <= max(1, 0.001 * diffs.numel()) and float(diffs.max()) < 1e-2 * lr, (step, off, float(diffs.max()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Per mode: the torch engine (1 process) and fsdp2 (2 ranks, a sharded checkpoint after step 1)."""
    root = tmp_path_factory.mktemp("fsdp2")
    out = {}
    for mode, lora in (("lora", True), ("full", False)):
        _launch(root / mode / "torch", "torch", lora)
        _launch(root / mode / "fsdp2", "fsdp2", lora, world=2, extra=("--save-shards",))
        out[mode] = root / mode
    return out


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_ranks_match_the_single_process_engine(runs: dict, mode: str):
    root = runs[mode]
    for step in (1, 2):
        ref = load_file(str(root / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(root / "fsdp2" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR[mode], step)
    # the update is real: the weights moved far more than the tolerance
    init = load_file(str(root / "torch" / "state-0.safetensors"))
    assert _max_diff(init, load_file(str(root / "torch" / "state-1.safetensors"))) > 100 * 1e-5
    assert (root / "fsdp2" / "ckpt" / "shards" / "rank-00001-of-00002.safetensors").is_file()
    expected = "pytorch_lora_weights.safetensors" if mode == "lora" else "transformer/diffusion_pytorch_model.safetensors"
    assert (root / "fsdp2" / "ckpt" / expected).is_file()


def test_sharded_checkpoint_loads_on_one_rank_and_training_continues(runs: dict, tmp_path: Path):
    two = runs["lora"] / "fsdp2"
    _launch(tmp_path / "one", "fsdp2", True, extra=("--load-shards", str(two / "ckpt")))
    saved = load_file(str(two / "state-1.safetensors"))
    assert _max_diff(saved, load_file(str(tmp_path / "one" / "loaded.safetensors"))) == 0.0
    # step 2 after loading equals step 2 of the uninterrupted run: AdamW moments came back too
    cont = load_file(str(tmp_path / "one" / "state-2.safetensors"))
    _assert_same_update(load_file(str(two / "state-2.safetensors")), cont, LR["lora"], 2)


def test_a_rank_with_no_samples_of_its_own_still_matches(tmp_path: Path):
    """Minibatches of one sample on 2 ranks: rank 1 only joins the collectives (zero-weight passes) and
    reports the metric names at weight 0; the update equals the single-process engine's."""
    layout = ("--layout", "one-sample-minibatches")
    _launch(tmp_path / "torch", "torch", True, extra=layout)
    _launch(tmp_path / "fsdp2", "fsdp2", True, world=2, extra=layout)
    for step in (1, 2):
        ref = load_file(str(tmp_path / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(tmp_path / "fsdp2" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR["lora"], step)
    ref_m = json.loads((tmp_path / "torch" / "metrics.json").read_text())
    got_m = json.loads((tmp_path / "fsdp2" / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        assert set(metrics) == set(got_m[step])
        for key in ("loss", "rs/rejected_frac", "is/seq_weight_max", "logprob/abs_delta_max"):
            assert got_m[step][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


def test_bypass_mask_fix_ups_on_two_ranks_match_the_single_process(tmp_path: Path):
    """Bypass mode with a mismatched rollout (offsets on its log-probs) and a band that flips a sample's
    mask once all its steps are seen: the ranks agree on their fix-up passes and the update equals the
    single-process engine's."""
    layout = ("--layout", "bypass-mismatch")
    _launch(tmp_path / "torch", "torch", True, extra=layout)
    _launch(tmp_path / "fsdp2", "fsdp2", True, world=2, extra=layout)
    ref_m = json.loads((tmp_path / "torch" / "metrics.json").read_text())
    got_m = json.loads((tmp_path / "fsdp2" / "metrics.json").read_text())
    for step in (1, 2):
        assert ref_m[str(step)]["rs/corrected_units"] > 0 and got_m[str(step)]["rs/corrected_units"] > 0
        assert got_m[str(step)]["rs/rejected_frac"] == pytest.approx(ref_m[str(step)]["rs/rejected_frac"])
        ref = load_file(str(tmp_path / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(tmp_path / "fsdp2" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR["lora"], step)


def test_both_wan_a14b_experts_are_sharded_and_match_the_single_process(tmp_path: Path):
    """Two trained modules (Wan2.2 A14B's high- and low-noise experts): each is sharded, both learn, and
    the update equals the single-process engine's; the sharded checkpoint holds both."""
    layout = ("--layout", "wan-a14b")
    _launch(tmp_path / "torch", "torch", True, extra=layout)
    _launch(tmp_path / "fsdp2", "fsdp2", True, world=2, extra=(*layout, "--save-shards"))
    init = load_file(str(tmp_path / "torch" / "state-0.safetensors"))
    for step in (1, 2):
        ref = load_file(str(tmp_path / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(tmp_path / "fsdp2" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR["lora"], step)
    moved = load_file(str(tmp_path / "fsdp2" / "state-1.safetensors"))
    for expert in ("transformer.", "transformer_2."):
        keys = [k for k in init if k.startswith(expert)]
        assert keys and max(float((moved[k] - init[k]).abs().max()) for k in keys) > 1e-3, expert
    names = load_file(str(tmp_path / "fsdp2" / "ckpt" / "shards" / "rank-00000-of-00002.safetensors"))
    assert any(k.startswith("param/transformer_2.") for k in names)


@pytest.fixture(scope="module")
def thinker_runs(tmp_path_factory) -> Path:
    """GSPO (beta 0.01) on the tiny Qwen3-Omni thinker: the torch engine and fsdp2 on 2 ranks, LoRA and full
    fine-tuning (a sharded checkpoint after step 1 of the latter)."""
    root = tmp_path_factory.mktemp("thinker")
    layout = ("--layout", "qwen3-omni")
    for mode, lora in (("lora", True), ("full", False)):
        _launch(root / mode / "torch", "torch", lora, extra=layout)
        _launch(root / mode / "fsdp2", "fsdp2", lora, world=2,
                extra=(*layout, "--save-shards") if mode == "full" else layout)
    return root


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_gspo_on_the_qwen3_omni_thinker_on_two_ranks_matches_the_single_process(thinker_runs: Path, mode: str):
    """The policy scores through its decoder and output head, called by themselves (not the thinker's forward):
    the engine makes each an FSDP unit (``called_submodules``), so their parameters are gathered there."""
    root = thinker_runs / mode
    for step in (1, 2):
        ref = load_file(str(root / "torch" / f"state-{step}.safetensors"))
        got = load_file(str(root / "fsdp2" / f"state-{step}.safetensors"))
        _assert_same_update(ref, got, LR[mode], step)
    init = load_file(str(root / "torch" / "state-0.safetensors"))
    moved = load_file(str(root / "torch" / "state-1.safetensors"))
    assert _max_diff(init, moved) > 100 * 1e-5  # the update is real
    if mode == "full":  # the output head and the embeddings (the units outside the blocks) learn too
        for name in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
            assert float((moved[name] - init[name]).abs().max()) > 1e-4, name
    ref_m = json.loads((root / "torch" / "metrics.json").read_text())
    got_m = json.loads((root / "fsdp2" / "metrics.json").read_text())
    for step, metrics in ref_m.items():
        for key in ("loss", "kl", "grad_norm"):
            assert got_m[step][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key


def test_thinker_checkpoint_of_two_ranks_loads_on_one_and_training_continues(thinker_runs: Path, tmp_path: Path):
    two = thinker_runs / "full" / "fsdp2"
    assert (two / "ckpt" / "model" / "model.safetensors").is_file()
    _launch(tmp_path / "one", "fsdp2", False, extra=("--layout", "qwen3-omni", "--load-shards", str(two / "ckpt")))
    loaded = load_file(str(tmp_path / "one" / "loaded.safetensors"))
    assert _max_diff(load_file(str(two / "state-1.safetensors")), loaded) == 0.0
    cont = load_file(str(tmp_path / "one" / "state-2.safetensors"))
    _assert_same_update(load_file(str(two / "state-2.safetensors")), cont, LR["full"], 2)
