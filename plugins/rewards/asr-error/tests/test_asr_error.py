"""asr-error: the error rates equal jiwer's on the same normalised strings; the normalisation; the transcripts
equal transformers' ASR pipeline on the tiny random-weight Whisper; metric=logprob equals Whisper's own
cross-entropy loss on the text; the raw error rate an evaluation displays; the preset saved and loaded from a
directory scores the same; resampling; loading errors; HF_HUB_OFFLINE."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import jiwer
import numpy as np
import pytest
import torch
from omnirl_plugin_asr_error.reward import AsrError, AsrErrorOptions, to_whisper_rate
from omnirl_plugin_asr_error.text import cardinal, edit_distance, error_rate, normalise, ordinal
from omnirl_plugin_asr_error.tiny import tiny_whisper_directory

from omnirl_core.contracts.data import Speech
from omnirl_core.contracts.reward import ScoreDisplay
from omnirl_core.errors import UsageError
from omnirl_core.testing import check_import_is_cheap, check_reward, offline_error

TEXT = "Hello, my name is Anna."


@pytest.fixture(scope="module")
def tiny() -> AsrError:
    return AsrError(AsrErrorOptions(preset="tiny", device="cpu", max_new_tokens=8, batch_size=2))


@pytest.fixture(scope="module")
def tiny_transcripts(tiny: AsrError) -> list[str]:
    return tiny.transcribe(_waves())


def _waves() -> list[Speech]:
    rs = np.random.RandomState(0)
    t = np.arange(24000) / 24000
    arrays = [0.1 * rs.randn(24000), 0.3 * np.sin(2 * np.pi * 220 * t), 0.3 * np.sin(2 * np.pi * 440 * t[:12000])]
    return [Speech(torch.tensor(a, dtype=torch.float32), 24000, TEXT) for a in arrays]


@pytest.mark.parametrize("raw, expected", [
    ("Hello, World!", "hello world"),
    ("Twenty-three apples", "twenty three apples"),
    ("23 apples", "twenty three apples"),
    ("It costs 1,250 dollars.", "it costs one thousand two hundred fifty dollars"),
    ("Pi is 3.14", "pi is three point one four"),
    ("the 21st and the 2nd", "the twenty first and the second"),
    ("50% off", "fifty percent off"),
    ("at 7:45", "at seven forty five"),
    ("Don't STOP", "dont stop"),
    ("born in 1990", "born in one thousand nine hundred ninety"),
    ("  ...  ", ""),
])
def test_normalisation(raw: str, expected: str):
    assert normalise(raw) == expected


def test_number_words():
    assert cardinal(0) == "zero" and cardinal(100) == "one hundred"
    assert cardinal(2_000_019) == "two million nineteen"
    assert cardinal(1_001_000) == "one million one thousand"
    assert cardinal(10**15) == "one " + "zero " * 14 + "zero"
    assert [ordinal(n) for n in (1, 3, 12, 20, 42, 100)] == [
        "first", "third", "twelfth", "twentieth", "forty second", "one hundredth"]


def _pairs() -> list[tuple[str, str]]:
    rng = random.Random(0)
    words = ["the", "a", "cat", "sat", "on", "mat", "dog", "7", "apples,", "two.", "hello", "world!"]
    pairs = [("Hello, my name is Anna.", "hello my name is ana"), ("The train leaves at 7:45.", "the train leave at 745"),
             ("Dr. Smith bought 12 apples", "doctor smith bought twelve apples and"), ("Is it?", "")]
    for _ in range(40):
        ref = " ".join(rng.choice(words) for _ in range(rng.randint(1, 9)))
        hyp = " ".join(rng.choice(words) for _ in range(rng.randint(0, 9)))
        pairs.append((ref, hyp))
    return pairs


def test_cer_and_wer_equal_jiwer_on_the_same_normalised_strings():
    checked = 0
    for ref, hyp in _pairs():
        r, h = normalise(ref), normalise(hyp)
        assert error_rate(ref, hyp, "char") == pytest.approx(jiwer.cer(r, h), abs=1e-12), (r, h)
        assert error_rate(ref, hyp, "word") == pytest.approx(jiwer.wer(r, h), abs=1e-12), (r, h)
        checked += 1
    assert checked == 44
    assert edit_distance("kitten", "sitting") == 3 and edit_distance([], ["a"]) == 1


def test_an_empty_reference_is_an_error():
    with pytest.raises(ValueError, match="nothing to transcribe once normalised"):
        error_rate("?!", "hello", "char")


def test_score_is_one_minus_the_error_clipped_or_not():
    def fixed(options: AsrErrorOptions, transcripts: list[str]) -> AsrError:
        reward = AsrError.__new__(AsrError)  # the scoring only: transcripts given, no Whisper loaded
        reward.options = options
        reward.transcribe = lambda outputs: transcripts
        return reward

    outputs = [Speech(torch.zeros(16000), 16000, TEXT)] * 3
    transcripts = ["hello my name is anna", "hello my name is ana", "x" * 60]
    cer = [error_rate(TEXT, t, "char") for t in transcripts]
    assert cer[0] == 0 and cer[1] == pytest.approx(1 / 21) and cer[2] > 1
    assert fixed(AsrErrorOptions(), transcripts)(outputs, [TEXT] * 3) == [1.0, pytest.approx(20 / 21), 0.0]
    unclipped = fixed(AsrErrorOptions(clip=False), transcripts)(outputs, [TEXT] * 3)
    assert unclipped[2] == pytest.approx(1 - cer[2])
    display = AsrError.display_for(AsrErrorOptions(clip=False))  # what `omnirl eval` shows beside the score
    assert [display(s) for s in unclipped] == pytest.approx(cer, abs=1e-12)
    wer = fixed(AsrErrorOptions(metric="wer"), transcripts)(outputs, [TEXT] * 3)
    assert wer[:2] == [1.0, pytest.approx(1 - 1 / 5)]


def test_resampling_keeps_duration_and_pitch():
    t = np.arange(24000) / 24000
    speech = Speech(torch.tensor(0.5 * np.sin(2 * np.pi * 440 * t), dtype=torch.float32), 24000, TEXT)
    wave = to_whisper_rate(speech)
    assert wave.dtype == np.float32 and wave.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(wave))
    assert np.argmax(spectrum) == 440  # 1 s at 16 kHz: bin k is k Hz
    same = Speech(torch.tensor(wave), 16000, TEXT)
    assert np.array_equal(to_whisper_rate(same), wave)
    with pytest.raises(ValueError, match="non-finite"):
        to_whisper_rate(Speech(torch.full((10,), float("nan")), 16000, TEXT))


def test_transcripts_equal_transformers_asr_pipeline(tiny_transcripts: list[str]):
    from transformers import pipeline

    outputs, mine = _waves(), tiny_transcripts
    asr = pipeline("automatic-speech-recognition", model=str(tiny_whisper_directory()), device="cpu")
    kwargs = {"language": "en", "task": "transcribe", "max_new_tokens": 8, "num_beams": 1, "do_sample": False}
    theirs = [asr({"raw": to_whisper_rate(o), "sampling_rate": 16000}, generate_kwargs=kwargs)["text"].strip()
              for o in outputs]
    assert mine == theirs
    assert len(set(mine)) == len(mine), mine  # the tiny preset's transcript depends on the audio


def test_tiny_preset_saved_elsewhere_loads_through_the_path_and_scores_the_same(tiny_transcripts: list[str],
                                                                                tmp_path: Path):
    copy = tmp_path / "whisper"
    shutil.copytree(tiny_whisper_directory(), copy)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in copy.iterdir()}
    loaded = AsrError(AsrErrorOptions(path=str(copy), device="cpu", max_new_tokens=8, batch_size=3, clip=False))
    outputs = _waves()
    scores = check_reward(loaded, outputs, [TEXT] * 3)  # one finite float each, twice the same
    assert scores == [1 - error_rate(TEXT, t, "char") for t in tiny_transcripts]  # batches of 3 here, of 2 there


def test_missing_files_are_named(tmp_path: Path):
    with pytest.raises(UsageError) as err:
        AsrError(AsrErrorOptions(path=str(tmp_path), device="cpu"))
    assert err.value.message.startswith("asr-error (Whisper): config.json, model.safetensors, ")
    assert f"Put them in {tmp_path}" in err.value.render()


def test_bad_outputs_are_clear_errors(tiny: AsrError):
    with pytest.raises(TypeError, match="scores omnirl_core.contracts.Speech outputs.*not str"):
        tiny(["some text"], ["a"])


def test_hf_hub_offline_never_touches_the_network():
    out = offline_error("from omnirl_plugin_asr_error.reward import AsrError, AsrErrorOptions",
                        "AsrError(AsrErrorOptions(device='cpu'))")
    assert "missing for 'openai/whisper-large-v3-turbo'" in out and "HF_HUB_OFFLINE=1 is set" in out


def test_import_is_cheap():
    check_import_is_cheap("omnirl_plugin_asr_error")


def test_empty_and_over_30_s_waveforms_are_scored(tiny: AsrError):
    outputs = [Speech(torch.zeros(0), 24000, TEXT), Speech(0.1 * torch.randn(24000 * 35), 24000, TEXT)]
    scores = tiny(outputs, [TEXT] * 2)
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)


def test_an_evaluation_displays_the_raw_error_rate():
    assert AsrError.display_for(AsrErrorOptions()) == ScoreDisplay("cer", scale=-1.0, offset=1.0)
    assert AsrError.display_for(None) == ScoreDisplay("cer", scale=-1.0, offset=1.0)
    assert AsrError.display_for(AsrErrorOptions(metric="wer")) == ScoreDisplay("wer", scale=-1.0, offset=1.0)
    assert AsrError.display_for(AsrErrorOptions(metric="logprob")) is None


def test_logprob_is_whispers_own_loss_on_the_text_and_follows_the_audio():
    reward = AsrError(AsrErrorOptions(preset="tiny", device="cpu", metric="logprob", batch_size=2))
    same_text = reward(_waves(), [TEXT] * 3)
    assert len(set(same_text)) == 3 and all(s < 0 for s in same_text), same_text  # the audio moves it
    texts = [TEXT, "The train leaves at 7:45, from platform 3.", "Is it?"]  # lengths differ: padded batches
    outputs = [Speech(o.waveform, o.sample_rate, t) for o, t in zip(_waves(), texts)]
    scores = reward(outputs, texts)
    tokenizer, model = reward.processor.tokenizer, reward.model
    prefix = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                              "<|notimestamps|>"])
    for output, score in zip(outputs, scores):
        features = reward.processor.feature_extractor(to_whisper_rate(output), sampling_rate=16000,
                                                      return_tensors="pt").input_features
        target = [*tokenizer(" " + output.text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        with torch.no_grad():  # transformers' cross-entropy over the labels, the prefix masked out
            loss = model(input_features=features, decoder_input_ids=torch.tensor([prefix + target[:-1]]),
                         labels=torch.tensor([[-100] * (len(prefix) - 1) + target])).loss
        assert score == pytest.approx(-float(loss), abs=1e-5)
    with pytest.raises(UsageError, match="language is None, not one of the checkpoint"):
        AsrError(AsrErrorOptions(preset="tiny", device="cpu", metric="logprob", language=None))
