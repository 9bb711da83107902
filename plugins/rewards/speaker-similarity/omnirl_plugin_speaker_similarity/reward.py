"""Speaker similarity: cos(e(sample), e(reference voice)), ``e`` the x-vector speaker embedding of a
``WavLMForXVector`` (default microsoft/wavlm-base-plus-sv), in [-1, 1]; that model's card takes 0.86 as the
same-speaker threshold.

As transformers documents the model: the ``Wav2Vec2FeatureExtractor`` at 16 kHz (other rates are resampled with a
polyphase filter, ``scipy.signal.resample_poly``), ``model(...).embeddings``, each L2-normalised, then their cosine.
Each waveform is embedded on its own: the checkpoint's first conv layer group-normalises over time, so zero padding
in a batch would change the embeddings. A waveform shorter than ``MIN_SECONDS`` (the TDNN and statistics pooling
need a few frames) is padded with silence to that length.

The reference voice of a sample: its prompt record's ``reference_field`` (a WAV path), else the ``reference``
option; reference embeddings are computed once per file (again when the file changes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.contracts.data import Speech
from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.options import ModelRewardOptions
from omnirl_plugin_speaker_similarity.wav import read_wav

DEFAULT_PATH = "microsoft/wavlm-base-plus-sv"
MODEL_RATE = 16000
MIN_SECONDS = 0.5
LABEL = "speaker-similarity (WavLM x-vector)"


class SpeakerSimilarityOptions(ModelRewardOptions):
    path: str = Field(DEFAULT_PATH, description="The WavLMForXVector checkpoint and its feature extractor: a local "
                      "directory or a hub id.")
    reference_field: str = Field("voice", description="Prompt-record field holding the reference voice (a PCM WAV "
                                 "path) that a sample is compared with.")
    reference: str | None = Field(None, description="One reference voice (PCM WAV path) for every prompt whose "
                                  "record has none.")


def input_fields(options: SpeakerSimilarityOptions | None) -> tuple[str, ...]:
    """The record field every prompt must hold: the reference voice's, unless one reference is given for all."""
    options = options or SpeakerSimilarityOptions()
    return () if options.reference else (options.reference_field,)


def speech_of(output: object) -> Speech:
    if not isinstance(output, Speech):
        raise TypeError(f"speaker-similarity scores omnirl_core.contracts.Speech outputs (a speech model's), not "
                        f"{type(output).__name__}")
    return output


def resample(wave: Any, rate: int) -> Any:
    """A float32 numpy waveform at ``rate`` Hz as one at the model's 16 kHz (polyphase filter)."""
    import numpy as np

    if rate != MODEL_RATE and wave.size:
        from scipy.signal import resample_poly

        g = math.gcd(MODEL_RATE, rate)
        wave = resample_poly(wave, MODEL_RATE // g, rate // g)
    return np.ascontiguousarray(wave, dtype=np.float32)


def load_xvector(path: str, device: str, dtype: str) -> tuple[Any, Any]:
    """(WavLMForXVector in eval mode on ``device``, its feature extractor) from a local directory or a hub id;
    missing files are named in the error."""
    from transformers import Wav2Vec2FeatureExtractor, WavLMForXVector
    from transformers.utils import logging as transformers_logging

    from omnirl_core.rewards_kit.clip import DTYPES, from_pretrained, is_local, resolve_device

    transformers_logging.disable_progress_bar()
    if is_local(path) and Path(path).expanduser().is_dir():
        missing = [] if (Path(path).expanduser() / "preprocessor_config.json").is_file() else [
            "preprocessor_config.json"]
        model_missing = [f for f in ("config.json", "model.safetensors") if not (Path(path).expanduser() / f).is_file()]
        if missing or model_missing:
            raise UsageError(f"{LABEL}: {', '.join(model_missing + missing)} missing for '{path}'.",
                             details=[f"Put them in {Path(path).expanduser()}."],
                             hint="Copy the checkpoint's files there (`hf download microsoft/wavlm-base-plus-sv "
                             f"--local-dir {path}`), or point rewards.<i>.options.path at another directory, or "
                             "use preset=tiny.")
    model = from_pretrained(WavLMForXVector, path, LABEL, "path", model=True, processor=False, dtype=DTYPES[dtype])
    extractor = from_pretrained(Wav2Vec2FeatureExtractor, path, LABEL, "path", model=False, processor=False)
    if extractor.sampling_rate != MODEL_RATE:
        raise UsageError(f"{LABEL}: the feature extractor of '{path}' expects {extractor.sampling_rate} Hz; this "
                         f"reward feeds {MODEL_RATE} Hz.", hint="Use a 16 kHz WavLM x-vector checkpoint.")
    return model.to(resolve_device(device)).eval().requires_grad_(False), extractor


class SpeakerSimilarity(Reward):
    uses_inputs = True  # the reference voice is in the prompt's record
    batch_invariant = True  # each waveform embedded on its own

    def __init__(self, options: SpeakerSimilarityOptions | None = None):
        self.options = options or SpeakerSimilarityOptions()
        if self.options.preset == "tiny":
            from omnirl_plugin_speaker_similarity.tiny import tiny_wavlm_directory

            path = str(tiny_wavlm_directory())
        else:
            path = self.options.path
        self.model, self.extractor = load_xvector(path, self.options.device, self.options.dtype)
        self._references: dict[str, tuple[tuple[int, int], Any]] = {}

    def embed(self, wave: Any, rate: int) -> Any:
        """The L2-normalised x-vector (1-D float32 tensor) of a mono float waveform at ``rate`` Hz."""
        import numpy as np
        import torch

        x = resample(np.asarray(wave, dtype=np.float32), rate)
        if not np.isfinite(x).all():
            raise ValueError("the waveform has non-finite samples (NaN or inf)")
        short = round(MIN_SECONDS * MODEL_RATE) - x.size
        if short > 0:
            x = np.concatenate([x, np.zeros(short, dtype=np.float32)])
        inputs = self.extractor(x, sampling_rate=MODEL_RATE, return_tensors="pt")
        with torch.no_grad():
            e = self.model(inputs.input_values.to(self.model.device, self.model.dtype)).embeddings[0].float()
        return torch.nn.functional.normalize(e, dim=-1).cpu()

    def reference_path(self, record: dict[str, Any] | None) -> str:
        value = (record or {}).get(self.options.reference_field)
        if value in (None, ""):
            value = self.options.reference
        if value in (None, ""):
            raise ValueError(f"the prompt's record has no reference voice (its '{self.options.reference_field}' "
                             "field) and the reward has no `reference` option: speaker-similarity needs a WAV to "
                             "compare with (set rewards.<i>.options.reference=FILE.wav or add the field to the data)")
        return str(value)

    def reference_embedding(self, path: str) -> Any:
        stat = Path(path).stat() if Path(path).is_file() else None
        key = (stat.st_mtime_ns, stat.st_size) if stat else (0, 0)
        cached = self._references.get(path)
        if cached is None or cached[0] != key:
            wave, rate = read_wav(path)
            cached = (key, self.embed(wave, rate))
            self._references[path] = cached
        return cached[1]

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],
                 inputs: Sequence[dict[str, Any]] | None = None, **kwargs: object) -> list[float]:
        records = list(inputs) if inputs is not None else [None] * len(outputs)
        if len(records) != len(outputs):
            raise ValueError(f"{len(records)} prompt records for {len(outputs)} samples")
        references = [self.reference_embedding(self.reference_path(r)) for r in records]
        scores = []
        for output, reference in zip(outputs, references):
            speech = speech_of(output)
            sample = self.embed(speech.waveform.detach().float().cpu().numpy(), speech.sample_rate)
            scores.append(float((sample * reference).sum()))
        return scores
