"""Signal checks on a spoken sample (``omnirl_core.contracts.Speech``), combined into one score in [0, 1].

Three sub-scores, each in [0, 1] (1 is best):
- clipping: ``1 - min(1, f / clip_tolerance)``, ``f`` the fraction of samples with ``|x| >= clip_level``;
- silence: ``1 - max(0, s - allowed_silence) / (1 - allowed_silence)``, ``s`` the fraction of frames (``frame_ms``,
  not overlapping) whose RMS is below ``silence_db`` dBFS; natural speech has pauses, so up to
  ``allowed_silence`` of them cost nothing;
- duration: ``1 / (1 + (log2(actual / expected) / duration_tolerance)^2)``, the expected seconds being the spoken
  text's letters and digits over ``chars_per_second`` (or its words over ``words_per_second``). The heavy tail
  keeps a slope far from the target (a speech twice too long scores 0.2, eight times 0.027), so a policy whose
  samples are all far off still sees which of them are closer.

The score is their weighted mean (``weights``, normalised to sum 1). An empty waveform scores 0 whatever the
weights. Nothing here knows whether the sound is speech: it is a cheap guard to combine with ``asr-error``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omnirl_core.contracts import Reward
from omnirl_core.contracts.data import Speech

SUB_SCORES = ("clipping", "silence", "duration")


class SpeechSignalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: dict[str, float] = Field(
        {"clipping": 0.25, "silence": 0.35, "duration": 0.4},
        description="Weight of each sub-score (clipping, silence, duration) in the score; normalised to sum 1. "
        "A sub-score left out weighs 0.")
    clip_level: float = Field(0.999, gt=0, le=1, description="|sample| at or above which a sample counts as clipped.")
    clip_tolerance: float = Field(0.01, gt=0, le=1, description="Fraction of clipped samples at which the clipping "
                                  "sub-score reaches 0 (linear from 1 at none).")
    frame_ms: float = Field(25.0, gt=0, description="Frame length in milliseconds for the silence check.")
    silence_db: float = Field(-40.0, lt=0, description="A frame whose RMS is below this level (dB relative to full "
                              "scale 1.0) is silent.")
    allowed_silence: float = Field(0.2, ge=0, lt=1, description="Fraction of silent frames that costs nothing "
                                   "(pauses, leading and trailing silence).")
    rate: Literal["chars", "words"] = Field("chars", description="What the expected duration counts in the "
                                            "spoken text: letters and digits, or words.")
    chars_per_second: float = Field(12.0, gt=0, description="Speaking rate with rate=chars (about 150 words per "
                                    "minute of English).")
    words_per_second: float = Field(2.5, gt=0, description="Speaking rate with rate=words (150 words per minute).")
    duration_tolerance: float = Field(0.5, gt=0, description="Octaves (log2 of actual / expected duration) at "
                                      "which the duration sub-score is 0.5.")

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(SUB_SCORES))
        if unknown:
            raise ValueError(f"unknown sub-score(s) {unknown}: the weights are for {', '.join(SUB_SCORES)}")
        if any(w < 0 or not math.isfinite(w) for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, not {weights}")
        return weights


@dataclass(frozen=True)
class SignalScores:
    """One sample's measurements and sub-scores."""

    clipped_fraction: float
    silent_fraction: float
    duration_s: float
    expected_s: float
    clipping: float
    silence: float
    duration: float
    score: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


_WORD = re.compile(r"\w+")


def expected_seconds(text: str, options: SpeechSignalOptions) -> float:
    """How long ``text`` takes to say at the options' speaking rate; an error for a text with nothing to say."""
    if options.rate == "words":
        count, rate = len(_WORD.findall(text)), options.words_per_second
    else:
        count, rate = sum(ch.isalnum() for ch in text), options.chars_per_second
    if count == 0:
        raise ValueError(f"the spoken text {text!r} has no {options.rate} to say: the duration check needs a text "
                         "(Speech.text) with letters or digits")
    return count / rate


def speech_of(output: object) -> Speech:
    if not isinstance(output, Speech):
        raise TypeError(f"speech-signal scores omnirl_core.contracts.Speech outputs (a speech model's), not "
                        f"{type(output).__name__}")
    return output


def signal_scores(speech: Speech, options: SpeechSignalOptions) -> SignalScores:
    import torch

    x = speech.waveform.detach().float().cpu()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"the waveform of {speech.text[:40]!r} has non-finite samples (NaN or inf)")
    expected = expected_seconds(speech.text, options)
    n = x.numel()
    if n == 0:
        return SignalScores(0.0, 1.0, 0.0, expected, 1.0, 0.0, 0.0, 0.0)
    clipped = float((x.abs() >= options.clip_level).float().mean())
    frame = max(1, round(speech.sample_rate * options.frame_ms / 1000))
    pad = (-n) % frame  # the last partial frame counts as a frame of its own samples' RMS
    frames = torch.nn.functional.pad(x, (0, pad)).view(-1, frame)
    counts = torch.full((frames.shape[0],), float(frame))
    counts[-1] = frame - pad
    rms = (frames.square().sum(dim=1) / counts).sqrt()
    silent = float((rms < 10 ** (options.silence_db / 20)).float().mean())
    duration = n / speech.sample_rate

    clipping_score = 1.0 - min(1.0, clipped / options.clip_tolerance)
    silence_score = 1.0 - max(0.0, silent - options.allowed_silence) / (1.0 - options.allowed_silence)
    octaves = math.log2(duration / expected)
    duration_score = 1.0 / (1.0 + (octaves / options.duration_tolerance) ** 2)
    subs = {"clipping": clipping_score, "silence": silence_score, "duration": duration_score}
    total = sum(options.weights.values())
    score = sum(w * subs[k] for k, w in options.weights.items()) / total
    return SignalScores(clipped, silent, duration, expected, clipping_score, silence_score, duration_score, score)


class SpeechSignal(Reward):
    batch_invariant = True  # each sample on its own

    def __init__(self, options: SpeechSignalOptions | None = None):
        self.options = options or SpeechSignalOptions()

    def breakdown(self, outputs: Sequence[Any]) -> list[SignalScores]:
        """Each sample's measurements and sub-scores (what ``__call__`` combines)."""
        return [signal_scores(speech_of(o), self.options) for o in outputs]

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: object) -> list[float]:
        return [s.score for s in self.breakdown(outputs)]
