"""speaker-similarity: the score equals transformers' documented x-vector recipe on the same (tiny, random)
weights; reference voices from the record or the option; PCM WAV reading and its errors; the preset saved and
loaded from a directory scores the same; loading errors; HF_HUB_OFFLINE."""

from __future__ import annotations

import shutil
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_speaker_similarity.reward import (
    SpeakerSimilarity,
    SpeakerSimilarityOptions,
    input_fields,
    resample,
)
from omnirl_plugin_speaker_similarity.tiny import tiny_wavlm_directory
from omnirl_plugin_speaker_similarity.wav import read_wav

from omnirl_core.contracts.data import Speech
from omnirl_core.errors import UsageError
from omnirl_core.testing import check_import_is_cheap, check_reward, offline_error


@pytest.fixture(scope="module")
def tiny() -> SpeakerSimilarity:
    return SpeakerSimilarity(SpeakerSimilarityOptions(preset="tiny", device="cpu"))


def _voice(f0: float, seconds: float = 1.0, sr: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    rs = np.random.RandomState(seed)
    x = sum(np.sin(2 * np.pi * f0 * k * t + rs.uniform(0, 6)) / k for k in (1, 2, 3, 4))
    return (0.2 * x * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.005 * rs.randn(t.size)).astype(np.float32)


def _write_wav(path: Path, x: np.ndarray, sr: int, width: int = 2, channels: int = 1) -> Path:
    frames = np.repeat(x[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = np.clip(np.round(frames * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    elif width == 3:
        ints = np.clip(np.round(frames * 2**23), -2**23, 2**23 - 1).astype(np.int32)
        raw = b"".join(struct.pack("<i", int(v))[:3] for v in ints)
    else:
        raw = np.clip(np.round(frames * 2**15), -2**15, 2**15 - 1).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(sr)
        f.writeframes(raw)
    return path


def recipe_similarity(model_dir: Path, a: np.ndarray, b: np.ndarray) -> float:
    """transformers' documented WavLMForXVector recipe: feature extractor, ``.embeddings``, normalise, cosine."""
    from transformers import Wav2Vec2FeatureExtractor, WavLMForXVector

    extractor = Wav2Vec2FeatureExtractor.from_pretrained(str(model_dir))
    model = WavLMForXVector.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        embeddings = [model(**extractor(x, sampling_rate=16000, return_tensors="pt")).embeddings for x in (a, b)]
    embeddings = [torch.nn.functional.normalize(e, dim=-1) for e in embeddings]
    return float(torch.nn.CosineSimilarity(dim=-1)(embeddings[0], embeddings[1])[0])


def test_scores_equal_the_documented_recipe(tiny: SpeakerSimilarity, tmp_path: Path):
    ref = _write_wav(tmp_path / "ref.wav", _voice(120, 1.2, seed=1), 16000)
    ref_wave, _ = read_wav(ref)
    samples = [Speech(torch.tensor(_voice(f0, 0.8, sr, seed=s)), sr, "hi")
               for f0, sr, s in ((120, 16000, 2), (220, 16000, 3), (180, 24000, 4))]
    got = tiny(samples, ["hi"] * 3, inputs=[{"voice": str(ref)}] * 3)
    expected = [recipe_similarity(tiny_wavlm_directory(), resample(o.waveform.numpy(), o.sample_rate), ref_wave)
                for o in samples]
    assert np.abs(np.asarray(got) - np.asarray(expected)).max() <= 1e-6, (got, expected)
    assert len({round(s, 6) for s in got}) == 3


def test_same_voice_scores_one_and_the_reference_comes_from_the_record_or_the_option(tiny: SpeakerSimilarity,
                                                                                   tmp_path: Path):
    low, high = _voice(110, seed=5), _voice(240, seed=6)
    low_wav, high_wav = _write_wav(tmp_path / "low.wav", low, 16000), _write_wav(tmp_path / "high.wav", high, 16000)
    sample = Speech(torch.tensor(read_wav(low_wav)[0]), 16000, "hi")
    own, other = tiny([sample, sample], ["a", "b"], inputs=[{"voice": str(low_wav)}, {"voice": str(high_wav)}])
    assert own == pytest.approx(1.0, abs=1e-5) and other < own
    with_option = SpeakerSimilarity(SpeakerSimilarityOptions(preset="tiny", device="cpu", reference=str(high_wav)))
    assert with_option([sample, sample], ["a", "b"], inputs=[{}, {"voice": str(low_wav)}]) == [
        pytest.approx(other, abs=1e-6), pytest.approx(own, abs=1e-6)]
    with pytest.raises(ValueError, match="has no reference voice \\(its 'voice' field\\)"):
        tiny([sample], ["a"], inputs=[{"prompt": "a"}])
    assert input_fields(SpeakerSimilarityOptions()) == ("voice",)
    assert input_fields(SpeakerSimilarityOptions(reference="r.wav", reference_field="ref")) == ()


def test_short_waveforms_are_padded_and_bad_outputs_are_errors(tiny: SpeakerSimilarity, tmp_path: Path):
    ref = str(_write_wav(tmp_path / "ref.wav", _voice(120), 16000))
    short = [Speech(torch.tensor(_voice(120, 0.05)), 16000, "hi"), Speech(torch.zeros(0), 16000, "hi")]
    scores = check_reward(lambda o, p: tiny(o, p, inputs=[{"voice": ref}] * len(o)), short, ["a", "b"])
    assert all(-1 <= s <= 1 for s in scores)
    with pytest.raises(TypeError, match="scores omnirl_core.contracts.Speech outputs.*not Tensor"):
        tiny([torch.zeros(100)], ["a"], inputs=[{"voice": ref}])


@pytest.mark.parametrize("width, channels", [(2, 1), (3, 1), (1, 1), (2, 2)])
def test_pcm_wav_reading(tmp_path: Path, width: int, channels: int):
    x = _voice(200, 0.1)
    wave_, sr = read_wav(_write_wav(tmp_path / "v.wav", x, 22050, width, channels))
    assert sr == 22050 and wave_.dtype == np.float32 and wave_.shape == x.shape
    assert np.abs(wave_ - x).max() <= {1: 1 / 128, 2: 1 / 2**15, 3: 1 / 2**23}[width]


def test_wav_errors_name_the_file_and_the_fix(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="reference voice .*missing.wav does not exist"):
        read_wav(tmp_path / "missing.wav")
    float_wav = tmp_path / "float.wav"
    data = np.zeros(16, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)  # WAVE_FORMAT_IEEE_FLOAT
    float_wav.write_bytes(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
                          + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)
    with pytest.raises(ValueError, match=r"float.wav is not a PCM WAV file .*ffmpeg -i .*pcm_s16le"):
        read_wav(float_wav)
    mp3 = tmp_path / "voice.mp3"
    mp3.write_bytes(b"ID3\x03\x00" + bytes(64))
    with pytest.raises(ValueError, match="voice.mp3 is not a PCM WAV file"):
        read_wav(mp3)


def test_tiny_preset_saved_elsewhere_loads_through_the_path_and_scores_the_same(tiny: SpeakerSimilarity,
                                                                                tmp_path: Path):
    copy = tmp_path / "wavlm"
    shutil.copytree(tiny_wavlm_directory(), copy)
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in copy.iterdir()}
    loaded = SpeakerSimilarity(SpeakerSimilarityOptions(path=str(copy), device="cpu"))
    ref = str(_write_wav(tmp_path / "ref.wav", _voice(150), 16000))
    samples = [Speech(torch.tensor(_voice(f0, 0.6)), 16000, "hi") for f0 in (100, 200)]
    inputs = [{"voice": ref}] * 2
    assert loaded(samples, ["a", "b"], inputs=inputs) == tiny(samples, ["a", "b"], inputs=inputs)


def test_missing_files_are_named(tmp_path: Path):
    with pytest.raises(UsageError) as err:
        SpeakerSimilarity(SpeakerSimilarityOptions(path=str(tmp_path), device="cpu"))
    assert err.value.message.startswith(
        "speaker-similarity (WavLM x-vector): config.json, model.safetensors, preprocessor_config.json missing")
    assert f"Put them in {tmp_path}" in err.value.render()


def test_hf_hub_offline_never_touches_the_network():
    out = offline_error("from omnirl_plugin_speaker_similarity.reward import SpeakerSimilarity",
                        "SpeakerSimilarity()")
    assert "missing for 'microsoft/wavlm-base-plus-sv'" in out and "HF_HUB_OFFLINE=1 is set" in out


def test_import_is_cheap():
    check_import_is_cheap("omnirl_plugin_speaker_similarity")
