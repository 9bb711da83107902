"""The SGLang engine on the tiny Qwen3-Omni thinker (random weights, CPU, fp32, SGLang's torch-native CPU path),
against the trainer: per-token log-probs, prefix sharing, weight sync, and GSPO training through the CLI.

The tests marked ``engines`` need the engine's environment (``omnirl env build sglang``) and skip without it;
they share one SGLang start per engine arguments (the engine keeps one server per process) but the last, a
real ``omnirl train`` process with its own. The rest check the request and response boundary and run anywhere.
The tiny preset's text heads are widened to 64 as for the vLLM engine (the same model directory serves both).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omnirl_plugin_sglang.engine import SglangRolloutOptions, check_sampling
from omnirl_plugin_sglang.server import cut, parse_output, sampling_params

from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.ar.sampling import completion_tokens
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest
from omnirl_core.errors import UsageError
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing import check_weight_update_reaches_engine, require_engine_environment

PROMPTS = ["Hi there", "What is two plus two? Answer with a letter.", "Name a colour", "x"]
ENGINE = {"max_new_tokens": 12, "context_length": 512}
SAMPLING = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "max_new_tokens": 12, "stop_token_ids": [151645]}


# -- the boundary: no engine needed ---------------------------------------------------------------------------
def test_request_sampling_parameters():
    params = sampling_params(SAMPLING, seed=7)
    assert params["top_k"] == -1 and params["top_p"] == 1.0 and params["sampling_seed"] == 7
    assert params["ignore_eos"] and params["stop_token_ids"] == [151645] and params["min_p"] == 0.0
    assert not cut(SAMPLING)
    # top-p alone goes as top-k over the whole vocabulary (SGLang's sampling mask takes a finite top-k only)
    nucleus = {**SAMPLING, "top_p": 0.9}
    assert cut(nucleus) and sampling_params(nucleus, 1, vocab_size=1000)["top_k"] == 1000
    assert sampling_params({**SAMPLING, "top_k": 50}, 1)["top_k"] == 50


def test_response_parsing():
    """Uncut: ``output_token_logprobs`` ((logprob, id, text) per token); cut: ``output_token_sampling_logprobs``."""
    response = {"output_ids": [5, 9], "meta_info": {"id": "r", "output_token_logprobs": [(-1.5, 5, None),
                                                                                      (-2.5, 9, None)],
                                                     "output_token_sampling_logprobs": [-0.5, -0.25]}}
    assert parse_output(response, cut=False) == ([5, 9], [-1.5, -2.5])
    assert parse_output(response, cut=True) == ([5, 9], [-0.5, -0.25])
    with pytest.raises(RuntimeError, match="1 sampling log-probs for 2 tokens"):
        parse_output({**response, "meta_info": {"output_token_sampling_logprobs": [-1.0]}}, cut=True)


def test_sglangs_own_request_classes_take_the_request():
    """The request the server builds, in SGLang's own ``GenerateReqInput`` / ``SamplingParams`` (skips where
    sglang is not importable: the trainer's environment)."""
    pytest.importorskip("sglang")
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    for s in (SAMPLING, {**SAMPLING, "top_k": 50}, {**SAMPLING, "top_p": 0.9}):
        params = sampling_params(s, 3, vocab_size=1000)
        SamplingParams(**params).verify(1000)
        obj = GenerateReqInput(input_ids=[[1, 2, 3]], sampling_params=[params], rid=["a"], return_logprob=True,
                               return_sampling_mask=cut(s))
        assert obj.sampling_params[0]["sampling_seed"] == 3


def test_sampling_sglang_cannot_match_is_refused():
    with pytest.raises(UsageError, match="top_k and top_p together"):
        check_sampling(SglangRolloutOptions(top_k=50, top_p=0.9))
    with pytest.raises(UsageError, match="allowed_tokens"):
        check_sampling(SglangRolloutOptions(allowed_tokens=["A", "B"]))
    check_sampling(SglangRolloutOptions(top_k=50))
    check_sampling(SglangRolloutOptions(top_p=0.9))


# -- the engine ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_environment():
    require_engine_environment("sglang")


def load(lora: bool = True, head_dim: int = 64):
    spec = get_plugin_manager().resolve("model", "qwen3-omni")
    options = spec.load_config()(tiny_head_dim=head_dim)
    m = spec.load_factory()(ModelSection(name="qwen3-omni", preset="tiny"), options, "cpu")
    m.setup_training(LoraConfig(rank=4, alpha=8) if lora else LoraConfig(enabled=False), need_reference=False)
    return m


@pytest.fixture(scope="module")
def model(engine_environment):
    return load()


def engine(model, **options):
    from omnirl_plugin_sglang.engine import SglangRolloutEngine

    return SglangRolloutEngine(model, SglangRolloutOptions(**{**ENGINE, **options}), torch.device("cpu"))


def requests(n: int = 8, seed: int = 100) -> list[GenRequest]:
    return [GenRequest(uid=i, prompt=PROMPTS[i % len(PROMPTS)], prompt_index=i % len(PROMPTS), group=i % len(PROMPTS),
                       seed=seed + i, height=0, width=0, plan=AR_PLAN) for i in range(n)]


def trainer_delta(model, samples) -> float:
    """Largest |trainer's re-scored log-prob - engine's| over every sampled token (logprob/abs_delta_max)."""
    with torch.no_grad():
        ours = model.token_logprobs([s.prompt_tokens for s in samples], [completion_tokens(s) for s in samples],
                                    [s.sampling for s in samples])
    return max(float((s.logprobs - o).abs().max()) for s, o in zip(samples, ours))


CASES = {
    "plain": {},
    "temperature-topk": {"temperature": 0.7, "top_k": 50},
    "temperature-topp": {"temperature": 0.7, "top_p": 0.9},
}


@pytest.mark.engines
@pytest.mark.parametrize("name", list(CASES))
def test_trainer_rescores_the_engines_logprobs(model, name):
    samples = list(engine(model, **CASES[name]).generate(requests()))
    assert [s.request.uid for s in samples] == list(range(8))
    delta = trainer_delta(model, samples)
    tokens = sum(len(completion_tokens(s)) for s in samples)
    print(f"{name}: {tokens} tokens, trainer vs SGLang log-probs max |delta| = {delta:.3g}")
    assert delta <= 1e-5, delta


@pytest.mark.engines
def test_prefix_sharing_in_the_radix_cache(model):
    """4 prompts x 4 samples, one request per sample, after a cache flush: what SGLang computes and what it takes
    from its radix cache, in one call and in a second call with the same prompts. Measured here: the requests of
    one call are prefilled in one batch, each computing its prompt; the second call finds every prompt cached."""
    eng = engine(model)
    eng.server.call("flush_cache")
    group = [GenRequest(uid=i, prompt=PROMPTS[i // 4], prompt_index=i // 4, group=i // 4, seed=i, height=0, width=0,
                        plan=AR_PLAN) for i in range(16)]
    rows = []
    for call in ("first", "second"):
        list(eng.generate(group))
        s = eng.last_stats
        rows.append(s)
        print(f"prefix sharing, {call} call: {s['prompt_tokens']} prompt tokens, "
              f"{s['prompt_tokens'] - s['cached_tokens']} computed, {s['cached_tokens']} from the radix cache")
    assert rows[1]["cached_tokens"] > rows[0]["cached_tokens"]


@pytest.mark.engines
@pytest.mark.parametrize("sync", ["auto", "full"])
def test_a_weight_update_reaches_the_engine(model, sync):
    check_weight_update_reaches_engine(model, lambda **o: engine(model, **o), requests(), trainer_delta, sync,
                                       seed=3 if sync == "auto" else 4, scale=0.1, tolerance=5e-5)


@pytest.mark.engines
def test_media_prompts_are_refused_clearly(model, tmp_path: Path):
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(tmp_path / "red.png")
    request = GenRequest(uid=0, prompt="Look", prompt_index=0, group=0, seed=1, height=0, width=0, plan=AR_PLAN,
                         inputs={"image": str(tmp_path / "red.png")})
    with pytest.raises(UsageError, match="text prompts only"):
        list(engine(model).generate([request]))


@pytest.mark.gpu
def test_the_rollout_engine_contract_on_a_gpu():
    """The core's contract, per-request seeds included: SGLang honours ``sampling_seed`` only with deterministic
    inference, which it refuses with its CPU attention (torch_native), so this runs on a GPU only."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (per-request seeds need SGLang's deterministic inference)")
    require_engine_environment("sglang", "cuda")
    from omnirl_plugin_sglang.engine import SglangRolloutEngine

    from omnirl_core.testing import check_rollout_engine

    check_rollout_engine(lambda m: SglangRolloutEngine(m, SglangRolloutOptions(**ENGINE), torch.device("cuda")),
                         load())


@pytest.mark.engines
def test_gspo_trains_through_the_cli_on_the_engine(engine_environment, tmp_path: Path):
    """`omnirl train --model qwen3-omni --algo gspo --set rollout.engine=sglang` (its own SGLang start): every
    step's rollout log-probs agree with the trainer's, so each LoRA update reached the engine, and the
    answer-match reward rises. Skipped: the tiny preset's GSPO samples with guided choice (allowed_tokens A-D),
    which the sglang engine does not offer yet; without it the answer letters are 4 of 152k random tokens."""
    pytest.skip("the tiny GSPO preset needs guided choice (allowed_tokens), not offered by the sglang engine yet")
    run = tmp_path / "run"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("omnirl")), "train", "--model", "qwen3-omni", "--algo", "gspo",
         "--preset", "tiny", "--steps", "16", "--set", "model.options.tiny_head_dim=64",
         "--set", "rollout.engine=sglang", "--set", "rollout.options.context_length=512",
         "--output-dir", str(run)], capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    worst = max(r["logprob/abs_delta_max"] for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    first, last = rewards[:5], rewards[-5:]
    se = (statistics.variance(first) / 5 + statistics.variance(last) / 5) ** 0.5
    print(f"omnirl train with rollout.engine=sglang: {len(rows)} steps, logprob/abs_delta_max <= {worst:.3g}, "
          f"reward first 5 {statistics.mean(first):.3f} -> last 5 {statistics.mean(last):.3f} "
          f"(standard error of the difference {se:.3f})")
    assert len(rows) == 16 and worst <= 1e-5, worst
    assert statistics.mean(last) - statistics.mean(first) >= max(2 * se, 0.1)
