"""ASR error: transcribe each spoken sample with Whisper and compare the transcript with the text it speaks.

reward = 1 - CER (or WER, ``metric``), clipped to [0, 1] unless ``clip`` is off; both texts normalised first
(``omnirl_plugin_asr_error.text``: lower case, no punctuation, numbers spelt as words). The text spoken is
``Speech.text`` (the prompt for text-to-speech, the thinker's answer when it was generated in the same rollout).
An evaluation shows the raw error rate beside the score (``display_for``: ``asr-error/cer`` = 1 - score).

``metric=logprob``: no decoding; the reward is the mean log-probability per token that Whisper's decoder gives the
text spoken (as Whisper writes a transcript: the text with one leading space, then ``<|endoftext|>``) after the
forced prefix, teacher-forced on the audio: an ASR likelihood that still ranks samples where every greedy
transcript is wrong (a small or random-weight Whisper's), and varies smoothly with the audio.

Whisper through transformers: ``WhisperProcessor`` (log-mel features over a 30 s window at 16 kHz; a waveform at
another rate is resampled with a polyphase filter, ``scipy.signal.resample_poly``) and
``WhisperForConditionalGeneration.generate`` decoding greedily (one beam, no sampling) from
``<|startoftranscript|><|language|><|transcribe|><|notimestamps|>``. Short-form only: a sample longer than 30 s is
cut at 30 s, and the words it lost count as deletions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.contracts.data import Speech
from omnirl_core.contracts.reward import ScoreDisplay
from omnirl_core.rewards_kit.options import ModelRewardOptions
from omnirl_plugin_asr_error.text import error_rate, normalised_reference

DEFAULT_PATH = "openai/whisper-large-v3-turbo"
WHISPER_RATE = 16000


class AsrErrorOptions(ModelRewardOptions):
    path: str = Field(DEFAULT_PATH, description="The Whisper checkpoint (model + processor): a local directory or a "
                      "hub id.")
    metric: Literal["cer", "wer", "logprob"] = Field(
        "cer", description="cer: 1 - character error rate (spaces count as characters), wer: 1 - word error rate, of "
        "the normalised texts; logprob: the mean log-probability per token Whisper's decoder gives the text spoken, "
        "teacher-forced on the audio (no decoding; ranks samples even where every transcript is wrong).")
    clip: bool = Field(True, description="Clip 1 - error to [0, 1]; off: 1 - error, below 0 when the transcript "
                       "has more errors than the text has characters (keeps a slope when every sample is far off). "
                       "Not used by metric=logprob.")
    language: str | None = Field("en", description="Language the transcript is forced to (a Whisper language code "
                                 "or name); None: Whisper detects it. None for English-only checkpoints (*.en).")
    max_new_tokens: int = Field(128, ge=1, le=440, description="Most tokens a transcript may have (a 30 s window "
                                "of speech is rarely over 100).")
    batch_size: int = Field(16, ge=1, description="Samples per Whisper call.")


def speech_of(output: object) -> Speech:
    if not isinstance(output, Speech):
        raise TypeError(f"asr-error scores omnirl_core.contracts.Speech outputs (a speech model's), not "
                        f"{type(output).__name__}")
    return output


def to_whisper_rate(speech: Speech) -> Any:
    """The waveform as a float32 numpy array at 16 kHz (polyphase resampling from any other integer rate)."""
    import numpy as np
    import torch

    x = speech.waveform.detach().float().cpu()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"the waveform of {speech.text[:40]!r} has non-finite samples (NaN or inf)")
    wave = x.numpy()
    if speech.sample_rate != WHISPER_RATE:
        from scipy.signal import resample_poly

        g = math.gcd(WHISPER_RATE, speech.sample_rate)
        wave = resample_poly(wave, WHISPER_RATE // g, speech.sample_rate // g) if wave.size else wave
    return np.ascontiguousarray(wave, dtype=np.float32)


def load_whisper(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    """(WhisperForConditionalGeneration in eval mode on ``device``, WhisperProcessor) from a local directory or a
    hub id; missing files are named in the error (``omnirl_core.rewards_kit.clip.from_pretrained``)."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor
    from transformers.utils import logging as transformers_logging

    from omnirl_core.rewards_kit.clip import DTYPES, from_pretrained, resolve_device

    transformers_logging.disable_progress_bar()
    model = from_pretrained(WhisperForConditionalGeneration, path, "asr-error (Whisper)", "path", model=True,
                            processor=True, dtype=DTYPES[dtype])
    processor = from_pretrained(WhisperProcessor, path, "asr-error (Whisper)", "path", model=False, processor=True)
    return model.to(resolve_device(device)).eval().requires_grad_(False), processor


class AsrError(Reward):
    @classmethod
    def display_for(cls, options: AsrErrorOptions | None) -> ScoreDisplay | None:
        """The raw error rate, 1 - score: ``cer`` or ``wer`` (with ``clip`` on, an error rate above 1 shows as 1);
        none for ``logprob``."""
        metric = (options or AsrErrorOptions()).metric
        return None if metric == "logprob" else ScoreDisplay(metric, scale=-1.0, offset=1.0)

    def __init__(self, options: AsrErrorOptions | None = None):
        self.options = options or AsrErrorOptions()
        if self.options.preset == "tiny":
            from omnirl_plugin_asr_error.tiny import tiny_whisper_directory

            path = str(tiny_whisper_directory())
        else:
            path = self.options.path
        self.model, self.processor = load_whisper(path, self.options.device, self.options.dtype)
        self.prefix: list[int] = []
        if self.options.metric == "logprob":
            self.prefix = self.forced_prefix()

    def forced_prefix(self) -> list[int]:
        """The decoder's forced start, as ``generate`` writes it from the generation config:
        ``<|startoftranscript|>``, the language and ``<|transcribe|>`` (multilingual checkpoints),
        ``<|notimestamps|>``."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        from omnirl_core.errors import UsageError

        config = self.model.generation_config
        prefix = [config.decoder_start_token_id]
        if config.is_multilingual:
            language = (self.options.language or "").lower()
            code = TO_LANGUAGE_CODE.get(language, language)
            if f"<|{code}|>" not in config.lang_to_id:
                raise UsageError(f"asr-error: metric=logprob scores the text in a given language, and language is "
                                 f"{self.options.language!r}, not one of the checkpoint's.",
                                 hint="Set rewards.N.options.language (e.g. en), or use metric=cer.")
            prefix += [config.lang_to_id[f"<|{code}|>"], config.task_to_id["transcribe"]]
        return [*prefix, config.no_timestamps_token_id]

    def text_logprobs(self, outputs: Sequence[Any]) -> list[float]:
        """Per sample, the mean over the text's tokens and ``<|endoftext|>`` of log p(token | audio, prefix, the
        tokens before it) under Whisper's decoder (one teacher-forced forward per batch, float32 log-softmax)."""
        import torch

        speeches = [speech_of(o) for o in outputs]
        tokenizer = self.processor.tokenizer
        eot = tokenizer.eos_token_id
        limit = self.model.config.max_target_positions
        targets = []
        for s in speeches:
            normalised_reference(s.text)  # a text with nothing to say is an error, as for the error rates
            ids = [*tokenizer(" " + s.text.strip(), add_special_tokens=False).input_ids, eot]
            if len(self.prefix) + len(ids) - 1 > limit:
                raise ValueError(f"the text {s.text[:40]!r}... is {len(ids)} Whisper tokens, over the decoder's "
                                 f"{limit} positions")
            targets.append(ids)
        waves = [to_whisper_rate(s) for s in speeches]
        out: list[float] = []
        device, dtype = self.model.device, self.model.dtype
        p = len(self.prefix)
        for start in range(0, len(waves), self.options.batch_size):
            batch = targets[start:start + self.options.batch_size]
            features = self.processor.feature_extractor(
                waves[start:start + self.options.batch_size], sampling_rate=WHISPER_RATE, return_tensors="pt")
            width = p + max(len(t) for t in batch) - 1
            # right-padded with <|endoftext|>: the decoder is causal, so padding never reaches a scored position
            inputs = torch.full((len(batch), width), eot, dtype=torch.long)
            for row, t in enumerate(batch):
                inputs[row, :p + len(t) - 1] = torch.tensor([*self.prefix, *t[:-1]])
            with torch.no_grad():
                logits = self.model(input_features=features.input_features.to(device, dtype),
                                    decoder_input_ids=inputs.to(device)).logits
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
            for row, t in enumerate(batch):
                positions = torch.arange(p - 1, p - 1 + len(t))
                out.append(float(logp[row, positions, torch.tensor(t)].mean()))
        return out

    def transcribe(self, outputs: Sequence[Any]) -> list[str]:
        """Greedy Whisper transcripts, one per sample."""
        import torch

        waves = [to_whisper_rate(speech_of(o)) for o in outputs]
        texts: list[str] = []
        device, dtype = self.model.device, self.model.dtype
        for start in range(0, len(waves), self.options.batch_size):
            features = self.processor.feature_extractor(
                waves[start:start + self.options.batch_size], sampling_rate=WHISPER_RATE, return_tensors="pt",
                return_attention_mask=True)
            with torch.no_grad():
                ids = self.model.generate(
                    features.input_features.to(device, dtype), attention_mask=features.attention_mask.to(device),
                    language=self.options.language, task="transcribe", do_sample=False, num_beams=1,
                    max_new_tokens=self.options.max_new_tokens)
            texts += [t.strip() for t in self.processor.batch_decode(ids, skip_special_tokens=True)]
        return texts

    def errors(self, outputs: Sequence[Any]) -> list[tuple[str, float]]:
        """(transcript, error rate against ``Speech.text``) per sample."""
        unit = "word" if self.options.metric == "wer" else "char"
        for o in outputs:  # a bad text is an error before Whisper runs
            normalised_reference(speech_of(o).text)
        transcripts = self.transcribe(outputs)
        return [(t, error_rate(o.text, t, unit)) for o, t in zip(outputs, transcripts)]

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: object) -> list[float]:
        if self.options.metric == "logprob":
            return self.text_logprobs(outputs)
        scores = [1.0 - e for _, e in self.errors(outputs)]
        return [min(1.0, max(0.0, s)) for s in scores] if self.options.clip else scores
