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
from omnirl_plugin_sglang.server import WARM, cut, parse_output, sampling_params, shared_prompts

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
    # guided choice: the allowed ids are the parameter of the server's own logit processor, nothing else changes
    assert "custom_params" not in params
    guided = sampling_params({**SAMPLING, "allowed_token_ids": [32, 33, 151645]}, 1)
    assert guided["custom_params"] == {"allowed_token_ids": [32, 33, 151645]} and guided["top_k"] == -1


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

    for s in (SAMPLING, {**SAMPLING, "top_k": 50}, {**SAMPLING, "top_p": 0.9},
              {**SAMPLING, "allowed_token_ids": [5, 7, 151645]}):
        params = sampling_params(s, 3, vocab_size=1000)
        SamplingParams(**params).verify(1000)
        obj = GenerateReqInput(input_ids=[[1, 2, 3]], sampling_params=[params], rid=["a"], return_logprob=True,
                               return_sampling_mask=cut(s))
        assert obj.sampling_params[0]["sampling_seed"] == 3


def test_the_guided_choice_processor_keeps_only_the_allowed_tokens():
    """The server's logit processor, through SGLang's own serialisation (``CustomLogitProcessor.to_str`` /
    ``from_str``, as its scheduler loads it): by reference to this plugin's class, and the masked row's
    log-softmax is the trainer's guided-choice distribution (skips without sglang)."""
    pytest.importorskip("sglang")
    from omnirl_plugin_sglang.guided import AllowedTokens, processor
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    from omnirl_core.ar.sampling import SamplingParams as TrainerParams
    from omnirl_core.ar.sampling import sampling_logprobs

    loaded = CustomLogitProcessor.from_str(processor())
    assert type(loaded) is AllowedTokens and b"omnirl_plugin_sglang.guided" in bytes.fromhex(
        json.loads(processor())["callable"])
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    rows = [[3, 7, 49], [0]]
    masked = loaded(logits.clone(), [{"allowed_token_ids": r} for r in rows])
    for row, allowed in enumerate(rows):
        ours = sampling_logprobs(logits[row], TrainerParams(temperature=0.7, allowed_token_ids=tuple(allowed)))
        theirs = torch.log_softmax(masked[row] / 0.7, dim=-1)
        assert torch.equal(torch.isfinite(theirs), torch.isfinite(ours))
        assert torch.allclose(theirs[allowed], ours[allowed], atol=1e-6)


def test_the_prompts_prefilled_first_are_those_a_call_repeats():
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6], [4, 5], [1, 2, 3]]
    assert shared_prompts(prompts) == [[1, 2, 3], [4, 5]]
    assert shared_prompts([[1], [2], [1, 2]]) == []
    assert WARM["max_new_tokens"] == 1


def test_sampling_sglang_cannot_match_is_refused():
    with pytest.raises(UsageError, match="top_k and top_p together"):
        check_sampling(SglangRolloutOptions(top_k=50, top_p=0.9))
    with pytest.raises(UsageError, match="allowed_tokens and top_k / top_p together"):
        check_sampling(SglangRolloutOptions(allowed_tokens=["A", "B"], top_k=50))
    with pytest.raises(UsageError, match="allowed_tokens and top_k / top_p together"):
        check_sampling(SglangRolloutOptions(allowed_tokens=["A", "B"], top_p=0.9))
    check_sampling(SglangRolloutOptions(allowed_tokens=["A", "B"], temperature=0.7))
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
    "allowed-tokens": {"allowed_tokens": ["A", "B", "C", "D"], "temperature": 0.7, "max_new_tokens": 2},
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
    if name == "allowed-tokens":  # only the letters and the stop token are ever sampled
        allowed = {model.token_id(t) for t in "ABCD"} | set(model.stop_token_ids)
        assert all(set(completion_tokens(s).tolist()) <= allowed for s in samples)
        assert len({int(completion_tokens(s)[0]) for s in samples}) > 1


@pytest.mark.engines
def test_prefix_sharing_in_the_radix_cache(model):
    """4 prompts x 4 samples, one request per sample, each call after a cache flush: prefill tokens SGLang computes
    without sharing (all requests in one batch, each computing its prompt), with ``share_prefixes`` (each group's
    prompt prefilled once first, then each sample computes only its prompt's last token), and in a second call
    with the same prompts (all cached). Wall times are printed (README, "Prefix sharing")."""
    group = [GenRequest(uid=i, prompt=PROMPTS[i // 4], prompt_index=i // 4, group=i // 4, seed=i, height=0, width=0,
                        plan=AR_PLAN) for i in range(16)]
    distinct = sum(len(model.encode_prompt(group[4 * g]).input_ids) for g in range(4))
    rows = {}
    for share in (False, True, False, True):  # twice each, alternating: the wall times of the second pair count
        eng = engine(model, share_prefixes=share)
        eng.server.call("flush_cache")
        samples = list(eng.generate(group))
        first = dict(eng.last_stats)
        list(eng.generate(group))
        rows[share] = (first, dict(eng.last_stats))
        assert all(len(completion_tokens(s)) for s in samples)
    for share, (first, second) in rows.items():
        print(f"prefix sharing {'on' if share else 'off'}: {first['prompt_tokens']} prompt tokens, "
              f"{first['prefill_tokens']} computed ({first['shared_prompts']} shared prompts first), "
              f"{first['seconds']:.2f} s; same prompts again: {second['prefill_tokens']} computed, "
              f"{second['seconds']:.2f} s")
    off, on = rows[False][0], rows[True][0]
    assert off["prompt_tokens"] == on["prompt_tokens"] == 4 * distinct
    assert off["prefill_tokens"] == 4 * distinct and off["shared_prompts"] == 0
    # each group's prompt once, then one token per sample (SGLang recomputes a cached prompt's last token)
    assert on["shared_prompts"] == 4 and on["prefill_tokens"] == distinct + 16
    assert rows[False][1]["prefill_tokens"] == 16


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

    from omnirl_core.testing.engines import check_rollout_engine

    check_rollout_engine(lambda m: SglangRolloutEngine(m, SglangRolloutOptions(**ENGINE), torch.device("cuda")),
                         load())


@pytest.mark.engines
def test_gspo_trains_through_the_cli_on_the_engine(engine_environment, tmp_path: Path):
    """`omnirl train --model qwen3-omni --algo gspo --set rollout.engine=sglang` (its own SGLang start): every
    step's rollout log-probs agree with the trainer's, so each LoRA update reached the engine, and the
    answer-match reward rises. The tiny preset samples with guided choice (allowed_tokens A-D and the stop token):
    the server's logit processor inside SGLang. The reward is compared between the first 2 steps (the rollout
    before any update and after one) and the last 5: measured here, the reward is 0.91 at step 3 and 0.97-1.0 from
    step 4 on, so a window of 5 first steps would mix the rise into the baseline (the vLLM test's 5 vs 5 fits
    its slower start)."""
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
    first, last = rewards[:2], rewards[-5:]
    se = (statistics.variance(first) / 2 + statistics.variance(last) / 5) ** 0.5
    print(f"omnirl train with rollout.engine=sglang: {len(rows)} steps, logprob/abs_delta_max <= {worst:.3g}, "
          f"reward per step {[round(r, 3) for r in rewards]}: first 2 {statistics.mean(first):.3f} -> last 5 "
          f"{statistics.mean(last):.3f} (standard error of the difference {se:.3f})")
    assert len(rows) == 16 and worst <= 1e-5, worst
    # chance is 1/18 (B then a stop token, of A-D + stop): the learnt policy answers B nearly always
    assert statistics.mean(last) - statistics.mean(first) >= max(2 * se, 0.5)
