"""speech-signal: each check moves the score the right way, the sub-scores follow their formulas, and the
score has a slope towards the target duration (what a policy learns from)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from omnirl_plugin_speech_signal.reward import SpeechSignal, SpeechSignalOptions, expected_seconds
from pydantic import ValidationError

from omnirl_core.contracts.data import Speech
from omnirl_core.testing import check_import_is_cheap, check_reward

SR = 16000
TEXT = "Hello, my name is Annie."  # 18 letters: 1.5 s at 12 per second


def _voiced(seconds: float, amplitude: float = 0.3, sr: int = SR, seed: int = 0) -> torch.Tensor:
    """A speech-like signal: a 150 Hz tone with harmonics under a 4 Hz syllable envelope, plus a little noise."""
    t = torch.arange(round(seconds * sr)) / sr
    tone = sum(torch.sin(2 * math.pi * 150 * k * t) / k for k in (1, 2, 3))
    envelope = 0.6 + 0.4 * torch.sin(2 * math.pi * 4 * t)
    noise = 0.01 * torch.randn(t.numel(), generator=torch.Generator().manual_seed(seed))
    return (amplitude * tone / 1.84 * envelope + noise).float()


def _speech(wave: torch.Tensor, text: str = TEXT, sr: int = SR) -> Speech:
    return Speech(wave.float(), sr, text)


def test_a_clean_speech_of_the_right_length_scores_near_one():
    reward = SpeechSignal()
    [s] = reward.breakdown([_speech(_voiced(1.5))])
    assert s.expected_s == pytest.approx(1.5)
    assert s.clipped_fraction == 0 and s.silent_fraction == 0
    assert s.duration == pytest.approx(1.0) and s.score == pytest.approx(1.0)


def test_clipping_silence_and_a_wrong_length_each_score_lower():
    reward = SpeechSignal()
    clean = _voiced(1.5)
    clipped = (clean * 8).clamp(-1, 1)
    gappy = clean.clone()
    gappy[: round(0.6 * clean.numel())] = 0  # 60 % silent
    outputs = [_speech(clean), _speech(clipped), _speech(gappy), _speech(_voiced(6.0)), _speech(torch.zeros(24000))]
    scores = reward(outputs, [TEXT] * 5)
    assert all(s < scores[0] - 0.1 for s in scores[1:]), scores
    rows = reward.breakdown(outputs)
    assert rows[1].clipped_fraction > 0.1 and rows[1].clipping == 0.0 and rows[1].silence == 1.0
    assert rows[2].silent_fraction == pytest.approx(0.6, abs=0.02)
    assert rows[2].silence == pytest.approx(1 - (rows[2].silent_fraction - 0.2) / 0.8)
    assert rows[3].duration == pytest.approx(1 / (1 + (2 / 0.5) ** 2))  # two octaves too long
    assert rows[4].silent_fraction == 1.0 and rows[4].silence == 0.0
    assert rows[4].score == pytest.approx(0.25 * 1 + 0.35 * 0 + 0.4 * 1)  # all silent, right length


def test_the_score_rises_towards_the_expected_duration():
    reward = SpeechSignal()
    lengths = [0.1, 0.2, 0.4, 0.8, 1.2, 1.5]  # a random talker's short bursts growing to the target
    scores = reward([_speech(_voiced(s)) for s in lengths], [TEXT] * len(lengths))
    assert all(b > a for a, b in itertools.pairwise(scores)), scores
    assert scores[0] < 0.7 and scores[-1] == pytest.approx(1.0)
    long = reward([_speech(_voiced(s)) for s in (12.0, 6.0, 3.0)], [TEXT] * 3)
    assert long[0] < long[1] < long[2] < 1.0


def test_random_noise_of_a_random_length_scores_low_ish():
    g = torch.Generator().manual_seed(1)
    quiet = [_speech(0.003 * torch.randn(int(n), generator=g)) for n in (1200, 80000, 4000)]
    scores = SpeechSignal()(quiet, [TEXT] * 3)
    assert max(scores) < 0.5, scores


def test_empty_waveform_scores_zero_and_options_change_the_target():
    assert SpeechSignal()([_speech(torch.zeros(0))], [TEXT]) == [0.0]
    words = SpeechSignalOptions(rate="words", words_per_second=2.0)
    assert expected_seconds("one two, three four!", words) == pytest.approx(2.0)
    assert expected_seconds("ab 12.", SpeechSignalOptions(chars_per_second=4)) == pytest.approx(1.0)
    only_duration = SpeechSignal(SpeechSignalOptions(weights={"duration": 1.0}))
    assert only_duration([_speech(torch.zeros(round(1.5 * SR)))], [TEXT]) == [pytest.approx(1.0)]


def test_the_frame_rms_uses_the_sample_rate():
    wave = _voiced(1.5, sr=24000)
    [s] = SpeechSignal().breakdown([_speech(wave, sr=24000)])
    assert s.duration_s == pytest.approx(1.5) and s.silent_fraction == 0


def test_bad_inputs_are_clear_errors():
    reward = SpeechSignal()
    with pytest.raises(TypeError, match="scores omnirl_core.contracts.Speech outputs.*not Tensor"):
        reward([torch.zeros(3, 8, 8)], ["a"])
    with pytest.raises(ValueError, match="has no chars to say"):
        reward([_speech(_voiced(0.5), text=" ... ")], ["..."])
    nan = _voiced(0.5)
    nan[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite samples"):
        reward([_speech(nan)], [TEXT])
    with pytest.raises(ValidationError, match="unknown sub-score"):
        SpeechSignalOptions(weights={"loudness": 1.0})
    with pytest.raises(ValidationError, match="not all 0"):
        SpeechSignalOptions(weights={"duration": 0.0})


def test_reward_contract_and_cheap_import():
    check_reward(SpeechSignal(), [_speech(_voiced(1.0)), _speech(_voiced(2.0, seed=3))], [TEXT, TEXT])
    check_import_is_cheap("omnirl_plugin_speech_signal")
