"""The Qwen3-Omni talker as a token policy on the tiny omni preset (thinker + talker + code predictor + code2wav, saved
and loaded through ``Qwen3OmniMoeForConditionalGeneration.from_pretrained``): frames sampled by the transformers
engine vs re-scored by the trainer, the frame log-prob against a per-codebook reference written here from the
transformers modules' own forwards, a trained LoRA loaded back with peft, and code2wav's waveforms."""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

import pytest
import torch
from omnirl_plugin_qwen3_omni.talker import NO_CODE, SAMPLE_RATE, Qwen3OmniTalker
from omnirl_plugin_qwen3_omni.tiny import TINY_CODE_GROUPS, save_tiny_omni, tiny_talker

from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.config import LoraConfig
from omnirl_core.contracts import GenRequest, Speech
from omnirl_core.errors import UsageError
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.rundir.rundir import RunDir

TEXTS = ["Hello there.", "Call me at 555-0199, Dr. Smith!", "Yes.", "Twenty-one blue whales swam by."]


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return save_tiny_omni(tmp_path_factory.mktemp("qwen3-omni-tiny-omni"), seed=1)


def _talker(omni_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3OmniTalker:
    return tiny_talker(omni_dir, dtype)


def _requests(texts: list[str], seed: int = 0) -> list[GenRequest]:
    return [GenRequest(uid=i, prompt=t, prompt_index=i, group=0, seed=seed + i, height=0, width=0, plan=AR_PLAN)
            for i, t in enumerate(texts)]


def _engine(model: Qwen3OmniTalker, **options) -> Any:
    """The installed transformers rollout engine, by name (plugins do not import each other)."""
    spec = get_plugin_manager().resolve("engine", "transformers")
    settings = {"max_new_tokens": 10, "temperature": 0.9, "top_k": 40, **options}
    return spec.load_factory()(model, spec.load_config()(**settings), "cpu")


@pytest.fixture(scope="module")
def talker64(omni_dir: Path) -> Qwen3OmniTalker:
    """In float64 the two paths' matmuls differ only far below fp32: a gap is then a difference in what is computed
    (conditioning, positions, which codes are summed), not kernel noise."""
    model = _talker(omni_dir, torch.float64)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    return model


def test_rollout_and_trainer_agree_per_frame(talker64: Qwen3OmniTalker, omni_dir: Path):
    samples = list(_engine(talker64).generate(_requests(TEXTS)))
    for s in samples:
        frames = s.completion
        assert frames.dtype == torch.long and frames.dim() == 2 and frames.shape[1] == TINY_CODE_GROUPS
        assert s.logprobs.shape == (len(frames),) and s.logprobs.dtype == torch.float32
        spoken = frames[frames[:, 0] != talker64.codec_eos]
        assert ((spoken >= 0) & (spoken < talker64.codebook)).all()
        if not s.extras["truncated"]:  # stopped: the end-of-speech frame has no residual codes
            assert frames[-1, 0] == talker64.codec_eos and (frames[-1, 1:] == NO_CODE).all()
    with torch.no_grad():
        scored = talker64.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                         [s.sampling for s in samples])
    gaps = torch.cat([(a - s.logprobs).abs() for a, s in zip(scored, samples)])
    assert gaps.max() <= 1e-6, gaps.max()
    # a request's frames do not depend on its batch-mates
    [alone] = list(_engine(talker64).generate(_requests(TEXTS[1:2], seed=1)))
    assert torch.equal(alone.completion, samples[1].completion)


def test_rollout_and_trainer_agree_in_float32(omni_dir: Path):
    """The preset as it trains (fp32): the cached rollout and the teacher-forced trainer run different kernels, so
    the frame log-probs (sums of 4 codebooks, about -5 to -20) differ by fp32 noise: measured max 1.9e-6, one fp32
    step at |log-prob| 16-32 (0.0 in float64, above)."""
    model = _talker(omni_dir)
    samples = list(_engine(model, top_k=0).generate(_requests(TEXTS)))
    with torch.no_grad():
        scored = model.token_logprobs([s.prompt_tokens for s in samples], [s.completion for s in samples],
                                      [s.sampling for s in samples])
    gaps = torch.cat([(a - s.logprobs).abs() for a, s in zip(scored, samples)])
    assert gaps.max() <= 5e-6, gaps.max()


def _reference_frame_logprobs(model: Qwen3OmniTalker, text: str, frames: torch.Tensor, temperature: float) -> list:
    """Per frame, the list of its K codebook log-probs, from scratch: the talker's input built as transformers'
    omni ``generate`` does (user turn, the 9 assistant positions, one text token per frame), every frame scored by a
    fresh full forward of ``Qwen3OmniMoeTalkerForConditionalGeneration`` (no cache), each residual code by a fresh
    forward of the code predictor over [talker state, code 0, ..., code j-1] (its own head selection)."""
    omni, tok = model.module, model.tokenizer
    config, talker_config = omni.config, omni.config.talker_config
    talker = omni.talker
    embed = omni.thinker.get_input_embeddings()
    user = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}], tokenize=False)
    user_ids = tok(user, add_special_tokens=False)["input_ids"]
    said = tok("<|im_start|>assistant\n" + text, add_special_tokens=False)["input_ids"] + [config.im_end_token_id]

    def project(ids):
        return talker.text_projection(embed(torch.tensor(ids)))

    bos, eos, pad = project([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
    said_h = project(said)
    codec = talker.model.codec_embedding(torch.tensor([
        talker_config.codec_nothink_id, talker_config.codec_think_bos_id, talker_config.codec_think_eos_id,
        talker_config.speaker_id["ethan"], talker_config.codec_pad_id, talker_config.codec_bos_id]))
    assistant = [said_h[0], said_h[1], said_h[2], pad, pad, pad, pad, bos, said_h[3]]
    assistant = [a + (codec[i - 3] if i >= 3 else 0) for i, a in enumerate(assistant)]
    inputs = list(project(user_ids)) + assistant
    to_speak = list(said_h[4:]) + [eos]
    allowed = torch.full((talker_config.text_config.vocab_size,), float("-inf"))
    allowed[: model.codebook] = 0.0
    allowed[talker_config.codec_eos_token_id] = 0.0
    predictor = talker.code_predictor
    out = []
    for t, frame in enumerate(frames.tolist()):
        res = talker(inputs_embeds=torch.stack(inputs)[None], use_cache=False, output_hidden_states=True)
        logits = res.logits[0, -1] / temperature + allowed
        per_code = [torch.log_softmax(logits.double(), -1)[frame[0]].item()]
        if frame[0] == talker_config.codec_eos_token_id:
            out.append(per_code)
            break
        h = talker.model(inputs_embeds=torch.stack(inputs)[None], use_cache=False).last_hidden_state[0, -1]
        seq = [h, talker.model.codec_embedding(torch.tensor(frame[0]))]
        for j in range(1, len(frame)):
            logits_j = predictor(inputs_embeds=torch.stack(seq)[None], use_cache=False).logits[0, -1] / temperature
            per_code.append(torch.log_softmax(logits_j.double(), -1)[frame[j]].item())
            seq.append(predictor.model.codec_embedding[j - 1](torch.tensor(frame[j])))
        out.append(per_code)
        step = talker.model.codec_embedding(torch.tensor(frame[0])) + sum(
            predictor.model.codec_embedding[j - 1](torch.tensor(frame[j])) for j in range(1, len(frame)))
        inputs.append(step + (to_speak[t] if t < len(to_speak) else pad))
    return out


def test_frame_logprob_is_the_sum_of_codebook_references(talker64: Qwen3OmniTalker):
    [sample] = list(_engine(talker64, max_new_tokens=6, top_k=0).generate(_requests(TEXTS[3:4])))
    with torch.no_grad():
        [scored] = talker64.token_logprobs([sample.prompt_tokens], [sample.completion], [sample.sampling])
        reference = _reference_frame_logprobs(talker64, TEXTS[3], sample.completion, 0.9)
    assert len(reference) == len(scored)
    for per_code, frame, got in zip(reference, sample.completion, scored):
        assert len(per_code) == (1 if frame[0] == talker64.codec_eos else TINY_CODE_GROUPS)
        assert abs(sum(per_code) - float(got)) <= 3e-6, (per_code, float(got))  # fp32 log-softmax vs float64
    assert all(len(p) == TINY_CODE_GROUPS for p in reference[:-1])


def test_rows_that_stopped_at_their_first_frame_score_alone(talker64: Qwen3OmniTalker):
    """A micro-batch in which every sample is only its end-of-speech frame has no residual codes: the code predictor
    is not called (it refuses an empty batch), and each frame's log-prob is its first codebook's."""
    [sample] = list(_engine(talker64, max_new_tokens=6).generate(_requests(TEXTS[3:4])))
    eos = sample.completion[-1:].clone()
    eos[0, 0], eos[0, 1:] = talker64.codec_eos, NO_CODE
    with torch.no_grad():
        alone = talker64.token_logprobs([sample.prompt_tokens] * 2, [eos, eos], [sample.sampling] * 2)
        mixed = talker64.token_logprobs([sample.prompt_tokens] * 2, [eos, sample.completion], [sample.sampling] * 2)
    assert [len(a) for a in alone] == [1, 1] and torch.isfinite(alone[0]).all()
    assert torch.equal(alone[0], alone[1]) and torch.allclose(alone[0], mixed[0], rtol=0, atol=1e-9)  # float64


def test_trained_lora_loads_into_the_omni_model_and_changes_its_codes(omni_dir: Path, tmp_path: Path):
    from peft import PeftModel
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = _talker(omni_dir)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    assert all(".talker." in f".{n}" for n, p in model.module.named_parameters() if p.requires_grad)
    requests = _requests(TEXTS[:2], seed=5)
    before = list(_engine(model).generate(requests))
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=0.05)
    for _ in range(4):  # push the log-prob of other frames up: the policy moves away from `before`
        target = [torch.randint(0, model.codebook, (6, TINY_CODE_GROUPS), generator=torch.Generator().manual_seed(k))
                  for k in range(2)]
        logp = model.token_logprobs([s.prompt_tokens for s in before], target, [s.sampling for s in before])
        loss = -torch.cat(logp).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = list(_engine(model).generate(requests))
    assert any(not torch.equal(a.completion, b.completion) for a, b in zip(after, before))
    written = model.save_trained(tmp_path / "lora")
    assert written == ["adapter_model.safetensors", "adapter_config.json"]

    base = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(omni_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "lora")).base_model.model
    reloaded = Qwen3OmniTalker(loaded.eval(), model.tokenizer, "ethan", torch.device("cpu"), torch.float32)
    again = list(_engine(reloaded).generate(requests))
    for a, b in zip(again, after):  # the adapter read back by peft is the trained policy
        assert torch.equal(a.completion, b.completion)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def _decoded_length(frames: int, rates: list[int], ratios: list[int]) -> int:
    """code2wav's output length, from its layers: each upsampling transposed conv (kernel = stride) multiplies the
    length, each decoder block's causal transposed conv (kernel 2r, stride r, trimmed r on both sides) maps n to
    (n - 1) r."""
    n = frames
    for r in ratios:
        n *= r
    for r in rates:
        n = (n - 1) * r
    return n


def test_code2wav_speech_is_finite_24khz_of_the_expected_length(talker64: Qwen3OmniTalker, tmp_path: Path):
    from omnirl_core.loop.evaluation import save_samples

    samples = list(_engine(talker64, max_new_tokens=7).generate(_requests(TEXTS, seed=11)))
    config = talker64.code2wav.config
    for s in samples:
        assert isinstance(s.output, Speech) and s.output.sample_rate == SAMPLE_RATE == 24_000
        assert s.output.text == s.prompt
        spoken = int((s.completion[:, 0] != talker64.codec_eos).sum())
        wave_ = s.output.waveform
        assert wave_.dtype == torch.float32 and torch.isfinite(wave_).all()
        expected = _decoded_length(spoken, list(config.upsample_rates), list(config.upsampling_ratios)) if spoken else 0
        assert wave_.numel() == expected, (spoken, wave_.numel(), expected)
        if spoken:
            assert wave_.abs().max() <= 1.0 and wave_.pow(2).mean().sqrt() > 1e-3  # audible, not silence
    rows = save_samples(samples, tmp_path / "out")
    assert [r["file"] for r in rows] == [f"{n:04d}.wav" for n in range(len(samples))]
    with wave.open(str(tmp_path / "out" / rows[0]["file"])) as wav:
        assert wav.getframerate() == 24_000 and wav.getnchannels() == 1
        assert wav.getnframes() == samples[0].output.waveform.numel()
    run = RunDir(tmp_path / "run")  # a training run's samples: samples/step-N/NNN.wav, listed in step-N.jsonl
    run.samples.mkdir(parents=True)
    listing = run.save_grid(2, [s.output for s in samples], [s.prompt for s in samples], columns=2,
                            rewards=[0.5] * len(samples))
    lines = [json.loads(line) for line in listing.read_text().splitlines()]
    assert [line["audio"] for line in lines] == [f"step-000002/{n:03d}.wav" for n in range(len(samples))]
    assert lines[1]["prompt"] == TEXTS[1] and lines[1]["seconds"] == round(samples[1].output.duration_s, 3)
    with wave.open(str(run.samples / lines[1]["audio"])) as wav:
        assert wav.getnframes() == samples[1].output.waveform.numel()


def test_text_token_options_are_refused_for_the_talker(talker64: Qwen3OmniTalker):
    with pytest.raises(UsageError, match="codec codes"):
        _engine(talker64, allowed_tokens=["A", "B"])
    with pytest.raises(UsageError, match="media"):
        talker64.encode_prompt(GenRequest(uid=0, prompt="Hi", prompt_index=0, group=0, seed=0, height=0, width=0,
                                          plan=AR_PLAN, inputs={"image": "x.png"}))
