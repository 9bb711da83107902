"""The talker speaking the thinker's reply, generated in the same rollout (``model.options.speak=reply``), with the
thinker frozen (``train=talker``) or trained with it (``train=thinker+talker``), on the tiny omni preset: the speech's
text is the decoded reply, rollout and trainer agree per module, the reply's log-probs match the transformers
thinker's own forward, the gradient reaches both LoRAs, and the CLI trains the joint policy with GSPO."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model
from omnirl_plugin_qwen3_omni.talker import NO_CODE, TALKER_PART, THINKER_PART, Qwen3OmniTalker
from omnirl_plugin_qwen3_omni.tiny import TINY_CODE_GROUPS, save_tiny_omni, tiny_talker

from omnirl_core.ar.policy_gradient import AR_PLAN, SequenceUnit, part_metrics
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest, Speech
from omnirl_core.errors import UsageError
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing import run_train

PROMPTS = ["Hello there.", "What is 2 + 2?", "Name a colour.", "Say something kind."]
WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight", " nine", " ten"]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return save_tiny_omni(tmp_path_factory.mktemp("qwen3-omni-tiny-omni"), seed=1)


def _model(omni_dir: Path, train: str, dtype: torch.dtype = torch.float32, **options: Any) -> Qwen3OmniTalker:
    return tiny_talker(omni_dir, dtype, train=train, **{"reply_max_tokens": 6, **options})


def _requests(texts: list[str], seed: int = 0) -> list[GenRequest]:
    return [GenRequest(uid=i, prompt=t, prompt_index=i, group=0, seed=seed + i, height=0, width=0, plan=AR_PLAN)
            for i, t in enumerate(texts)]


def _engine(model: Qwen3OmniTalker, **options: Any) -> Any:
    """The installed transformers rollout engine, by name (plugins do not import each other)."""
    spec = get_plugin_manager().resolve("engine", "transformers")
    settings = {"max_new_tokens": 8, "temperature": 0.9, "top_k": 40, **options}
    return spec.load_factory()(model, spec.load_config()(**settings), "cpu")


@pytest.fixture(scope="module")
def joint64(omni_dir: Path) -> Qwen3OmniTalker:
    """In float64 the cached rollout and the teacher-forced trainer differ only far below fp32: a gap is then a
    difference in what is computed (the reply's positions, the talker's conditioning on it), not kernel noise."""
    model = _model(omni_dir, "thinker+talker", torch.float64)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    return model


def _thinker_reference(model: Qwen3OmniTalker, prompt_ids: torch.Tensor, reply: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """The reply's token log-probs from one full forward of the transformers thinker
    (``Qwen3OmniMoeThinkerForConditionalGeneration``, its own position ids and output head) over prompt + reply."""
    ids = torch.cat([prompt_ids, reply])[None]
    logits = model.thinker(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, reply[:, None])[:, 0]


def test_joint_rollout_and_trainer_agree_per_module(joint64: Qwen3OmniTalker):
    assert joint64.logprob_parts == ("thinker", "talker")
    samples = list(_engine(joint64, top_k=0).generate(_requests(PROMPTS)))
    for s in samples:
        rows = s.completion
        assert rows.shape[1] == 1 + TINY_CODE_GROUPS and s.logprobs.shape == (len(rows),)
        part = joint64.logprob_part_of(rows)
        n = int((part == THINKER_PART).sum())
        # the reply's tokens first, then the frames; the reply ends with the end of turn or at reply_max_tokens
        assert n >= 1 and (part[:n] == THINKER_PART).all() and (part[n:] == TALKER_PART).all() and len(rows) > n
        reply = rows[:n, 1]
        assert (rows[:n, 2:] == NO_CODE).all()
        assert int(reply[-1]) in joint64.stop_token_ids or n == joint64.reply_max_tokens
        assert isinstance(s.output, Speech) and s.output.text == joint64.tokenizer.decode(
            reply.tolist(), skip_special_tokens=True).strip() == s.extras["reply"]
        frames = rows[n:, 1:]
        spoken = int((frames[:, 0] != joint64.codec_eos).sum())
        assert s.output.waveform.numel() > 0 if spoken else s.output.waveform.numel() == 0
        with torch.no_grad():  # the thinker's part is what transformers' thinker forward gives the reply
            ref = _thinker_reference(joint64, s.prompt_tokens.input_ids, reply, 0.9)
        assert (ref - s.logprobs[:n].double()).abs().max() <= 1e-5  # fp32 log-softmax (values to -15) vs float64
    with torch.no_grad():
        scored = joint64.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                        [s.sampling for s in samples])
    for a, s in zip(scored, samples):
        part = joint64.logprob_part_of(s.completion)
        for k in (THINKER_PART, TALKER_PART):  # per module, per token / frame
            gap = (a - s.logprobs)[part == k].abs().max()
            assert gap <= 1e-6, (k, gap)
    # what the trainer logs: each module's share of the sequence's log-prob and its rollout-vs-trainer gap
    metrics = part_metrics(joint64, [SequenceUnit(s) for s in samples], scored)
    assert metrics["logprob/thinker/abs_delta_max"] <= 1e-6 and metrics["logprob/talker/abs_delta_max"] <= 1e-6
    total = sum(float(s.logprobs.double().sum()) for s in samples) / len(samples)
    assert metrics["logprob/thinker/sum"] + metrics["logprob/talker/sum"] == pytest.approx(total, abs=1e-4)
    assert metrics["logprob/thinker/sum"] < 0 and metrics["logprob/talker/sum"] < 0
    # a request's reply and frames do not depend on its batch-mates (a row draws only until its reply stops)
    [alone] = list(_engine(joint64, top_k=0).generate(_requests(PROMPTS[2:3], seed=2)))
    assert torch.equal(alone.completion, samples[2].completion)


def test_guided_reply_with_a_minimum_length(joint64: Qwen3OmniTalker):
    """``allowed_tokens`` guide the reply (the stop tokens stay allowed), and ``reply_min_tokens`` masks the stop tokens
    for the first tokens: with one allowed word, those tokens are that word with log-prob 0, in rollout and trainer."""
    joint64.reply_min_tokens = 3
    try:
        samples = list(_engine(joint64, allowed_tokens=[" one"]).generate(_requests(PROMPTS)))
        with torch.no_grad():
            scored = joint64.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                            [s.sampling for s in samples])
    finally:
        joint64.reply_min_tokens = 1
    one = joint64.token_id(" one")
    for s, a in zip(samples, scored):
        n = int((joint64.logprob_part_of(s.completion) == THINKER_PART).sum())
        reply = s.completion[:n, 1]
        assert n >= 3 and (reply[:3] == one).all() and (s.logprobs[:3] == 0).all() and (a[:3] == 0).all()
        assert all(int(t) == one or int(t) in joint64.stop_token_ids for t in reply)
        assert s.output.text.split()[:3] == ["one"] * 3
        assert (a - s.logprobs).abs().max() <= 1e-6


def test_frozen_thinker_speaks_its_reply(omni_dir: Path, joint64: Qwen3OmniTalker):
    """``train=talker, speak=reply``: the sequence is the frames alone, after a prompt that holds the reply; the
    reply and frames are the joint model's for the same seeds (same weights, LoRA at zero), and so are the frames'
    log-probs."""
    model = _model(omni_dir, "talker", torch.float64, speak="reply")
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    assert model.logprob_parts == () and all(".talker." in f".{n}" for n, p in model.module.named_parameters()
                                              if p.requires_grad)
    samples = list(_engine(model, top_k=0).generate(_requests(PROMPTS)))
    joint = list(_engine(joint64, top_k=0).generate(_requests(PROMPTS)))
    for s, j in zip(samples, joint):
        thinker_prompt = model.encode_prompt(s.request).input_ids
        reply = s.prompt_tokens.input_ids[len(thinker_prompt):]
        assert torch.equal(s.prompt_tokens.input_ids[:len(thinker_prompt)], thinker_prompt) and len(reply) >= 1
        assert s.output.text == model.tokenizer.decode(reply.tolist(), skip_special_tokens=True).strip()
        assert s.completion.shape[1] == TINY_CODE_GROUPS and s.logprobs.shape == (len(s.completion),)
        n = int((joint64.logprob_part_of(j.completion) == THINKER_PART).sum())
        assert torch.equal(j.completion[:n, 1], reply) and torch.equal(j.completion[n:, 1:], s.completion)
        assert torch.allclose(j.logprobs[n:], s.logprobs, rtol=0, atol=1e-6)
    with torch.no_grad():
        scored = model.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                      [s.sampling for s in samples])
    assert max(float((a - s.logprobs).abs().max()) for a, s in zip(scored, samples)) <= 1e-6


def test_prompt_mode_still_speaks_the_prompt(omni_dir: Path):
    model = _model(omni_dir, "talker")
    [s] = list(_engine(model, max_new_tokens=3).generate(_requests(PROMPTS[:1])))
    assert s.output.text == PROMPTS[0] and s.completion.shape[1] == TINY_CODE_GROUPS


def test_one_update_moves_both_loras(omni_dir: Path):
    model = _model(omni_dir, "thinker+talker")
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    names = [n for n, p in model.module.named_parameters() if p.requires_grad]
    assert any(n.startswith("thinker.model.language_model.") for n in names)
    assert any(n.startswith("talker.model.") for n in names) and any(".code_predictor." in n for n in names)
    assert all(n.startswith(("thinker.model.language_model.", "talker.")) and "lora_" in n for n in names)
    samples = list(_engine(model, allowed_tokens=WORDS).generate(_requests(PROMPTS)))
    assert all(s.output.text for s in samples)  # guided reply: words only
    before = {n: p.detach().clone() for n, p in model.module.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=1e-2)
    logp = model.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                [s.sampling for s in samples])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss = -(torch.stack([lp.mean() for lp in logp]) * advantages).mean()  # GSPO's sequence-level direction
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    moved = {n for n, p in model.module.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert any(n.startswith("thinker.") for n in moved) and any(n.startswith("talker.model.") for n in moved)
    assert any(".code_predictor." in n for n in moved)
    after = list(_engine(model, allowed_tokens=WORDS).generate(_requests(PROMPTS)))
    assert any(not torch.equal(a.completion, b.completion) for a, b in zip(after, samples))


def test_bad_settings_are_clear_errors(omni_dir: Path):
    section = ModelSection(name="qwen3-omni", preset="tiny", path=str(omni_dir), dtype="float32")
    with pytest.raises(UsageError, match="speak=prompt"):
        create_model(section, Qwen3OmniOptions(train="thinker+talker", speak="prompt"), "cpu")
    with pytest.raises(UsageError, match="speak"):
        create_model(section, Qwen3OmniOptions(train="thinker", speak="reply"), "cpu")


@pytest.mark.slow
def test_joint_training_through_the_cli(tmp_path: Path):
    """``omnirl train --algo gspo --preset tiny-talker --set model.options.train=thinker+talker``: exits 0, logs each
    module's log-prob share and rollout-vs-trainer gap, speaks the replies, and the saved adapter trained both."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    records = run_train(run, "--model", "qwen3-omni", "--algo", "gspo", "--preset", "tiny-talker",
                        "--set", "model.options.train=thinker+talker", "--reward", "speech-signal", "--steps", "2",
                        "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
                        "--set", "rollout.options.max_new_tokens=8", "--set", "model.options.reply_max_tokens=6",
                        "--set", "run.sample_every=1", "--set", "run.save_every=2")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["logprob/thinker/length"] >= 1 and r["logprob/talker/length"] >= 1
        assert r["logprob/thinker/sum"] < 0 and r["logprob/talker/sum"] < 0
        assert r["logprob/thinker/abs_delta_max"] <= 1e-4 and r["logprob/talker/abs_delta_max"] <= 1e-4  # fp32
    listing = [json.loads(line) for line in (run / "samples" / "step-000001.jsonl").read_text().splitlines()]
    assert len(listing) == 4 and all(x["audio"].endswith(".wav") for x in listing)
    assert any(x["text"] != x["prompt"] for x in listing)  # what was spoken: the thinker's reply, not the prompt
    adapters = sorted(run.rglob("adapter_model.safetensors"))
    assert adapters, sorted(str(p.relative_to(run)) for p in run.rglob("*"))[:40]
    state = load_file(str(adapters[-1]))
    for module in ("thinker.", "talker.model.", "talker.code_predictor."):
        b = [v for k, v in state.items() if module in k and "lora_B" in k]
        assert b and any(bool(v.abs().sum() > 0) for v in b), module  # zero at init: the update reached it


def test_joint_training_is_planned_with_both_loras(omni_dir: Path):
    """``omnirl plan`` with train=thinker+talker: both modules trained, the LoRA count that of peft injecting the
    joint model's own targets into the tiny whole model (thinker and talker adapters), more activation layers than
    the talker alone (the thinker's over prompt + reply)."""
    from types import SimpleNamespace

    from omnirl_plugin_qwen3_omni.sizing import sizing

    from omnirl_core.config import RunConfig

    def config(train: str) -> RunConfig:
        return RunConfig.model_validate({"model": {"name": "qwen3-omni", "preset": "tiny-talker",
                                                   "options": {"train": train}, "lora": {"rank": 4, "alpha": 8}},
                                         "rollout": {"options": {"max_new_tokens": 36}}})

    joint = sizing(config("thinker+talker"), SimpleNamespace(train="thinker+talker", reply_max_tokens=6))
    alone = sizing(config("talker"), SimpleNamespace(train="talker"))
    model = _model(omni_dir, "thinker+talker")
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    assert joint.trained == ("thinker", "talker") and alone.trained == ("talker",)
    assert joint.trainable == sum(p.numel() for p in model.trainable_parameters()) > alone.trainable
    assert joint.layers > alone.layers and joint.per_sample_bytes > alone.per_sample_bytes
