"""A tiny random-weight Whisper in the transformers layout, cached under ``$OMNIRL_CACHE/presets``.

``WhisperForConditionalGeneration`` (conv stem + transformer encoder over 30 s of log-mel frames, transformer
decoder) at small widths, with the released checkpoints' input format (16 kHz, 128 mel bins as
whisper-large-v3, 30 s windows: 3000 frames, 1500 encoder positions) and a Whisper tokenizer in the real format
(byte-level BPE ``vocab.json`` + ``merges.txt``, the ``<|endoftext|>``, ``<|startoftranscript|>``, language,
task and ``<|notimestamps|>`` special tokens, a generation config with ``lang_to_id`` / ``task_to_id``), all
saved with ``save_pretrained`` so that it loads back through the same ``from_pretrained`` path as a real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnirl_core.presets import SMALL_CORPUS, atomic_directory, cache_dir

TINY_VERSION = 1
INIT_STD = 1.0  # at transformers' 0.02 a tiny random decoder ignores the audio: the same transcript for every input
EOT, SOT = "<|endoftext|>", "<|startoftranscript|>"
LANGUAGES = ("en", "de", "fr")
TASKS = ("translate", "transcribe")
# the released order after the language tokens
SPECIALS = [SOT, *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>", "<|transcribe|>", "<|startoflm|>",
            "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
CORPUS = SMALL_CORPUS + (
    " hello my name is anna the train leaves at seven from platform three doctor smith bought twelve apples and "
    "two pears is it going to rain in paris tomorrow please call me back before noon we walked five miles along "
    "the river good morning mister brown she was born on may fourth how much is plus four turn left at the "
    "second light , ! ? ' : % -")


def whisper_tokenizer(directory: Path, vocab_size: int = 400) -> Any:
    """A Whisper tokenizer whose BPE is trained in milliseconds on a small corpus, ``<|endoftext|>`` the last
    regular id and the special tokens after it, as in the released vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator([CORPUS] * 4, trainer=trainer)
    bpe_dir = directory / "bpe"
    bpe_dir.mkdir()
    tk.model.save(str(bpe_dir))
    vocab = json.loads((bpe_dir / "vocab.json").read_text())
    vocab[EOT] = len(vocab)
    lines = (bpe_dir / "merges.txt").read_text().splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    for f in bpe_dir.iterdir():
        f.unlink()
    bpe_dir.rmdir()
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges, model_max_length=448)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


def save_tiny_whisper(directory: Path, seed: int = 0) -> None:
    """Build a random tiny Whisper + processor and ``save_pretrained`` both into ``directory``."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    torch.manual_seed(seed)
    tokenizer = whisper_tokenizer(directory)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in [EOT, *SPECIALS]}
    eot, sot = ids[EOT], ids[SOT]
    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=128, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=1500, max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, suppress_tokens=[], begin_suppress_tokens=[eot], init_std=INIT_STD,
    )
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        begin_suppress_tokens=[eot], suppress_tokens=[], is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={task: ids[f"<|{task}|>"] for task in TASKS},
        no_timestamps_token_id=ids["<|notimestamps|>"],
    )
    model.save_pretrained(str(directory))
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(directory))


def tiny_whisper_directory(seed: int = 0) -> Path:
    """The cached tiny Whisper checkpoint (built on first use)."""
    target = cache_dir() / "presets" / f"asr-error-whisper-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny_whisper(tmp, seed))
