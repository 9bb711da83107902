"""Tiny random-weight CLIP checkpoints in the transformers layout, cached under ``$OMNIRL_CACHE/presets``.

The released checkpoints' architecture (``CLIPModel``: ViT image tower, causal text transformer, linear
projections, ``logit_scale``) with small sizes, saved with ``save_pretrained`` (safetensors) together with a
``CLIPProcessor``, so that they load back through the same ``from_pretrained`` path as a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnirl_core.presets import SMALL_CORPUS, atomic_directory, cache_dir

TINY_VERSION = 1
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def clip_bpe_tokenizer(vocab_size: int = 512) -> Any:
    """A CLIP-style byte-level BPE (lower case, ``<|startoftext|> ... <|endoftext|>``, 77 tokens, padded
    with ``<|endoftext|>``) trained in milliseconds. As in the released CLIP vocabulary, the two special
    tokens come last, so ``<|endoftext|>`` has the highest id: open_clip pools the text at ``argmax(ids)``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator([SMALL_CORPUS] * 4, trainer=trainer)
    tk.add_special_tokens([BOS, EOS])
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B {EOS}",
        special_tokens=[(BOS, tk.token_to_id(BOS)), (EOS, tk.token_to_id(EOS))],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   unk_token=EOS, model_max_length=77)


def tiny_clip_config(vocab_size: int, eos_token_id: int, bos_token_id: int, hidden_act: str,
                     image_size: int = 32, patch_size: int = 8, width: int = 32, layers: int = 2, heads: int = 2,
                     projection_dim: int = 16) -> Any:
    from transformers import CLIPConfig

    common = {"hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
              "num_attention_heads": heads, "hidden_act": hidden_act, "projection_dim": projection_dim}
    return CLIPConfig(
        text_config={**common, "vocab_size": vocab_size, "max_position_embeddings": 77,
                     "eos_token_id": eos_token_id, "bos_token_id": bos_token_id, "pad_token_id": eos_token_id},
        vision_config={**common, "image_size": image_size, "patch_size": patch_size},
        projection_dim=projection_dim,
    )


def tiny_processor(tokenizer: Any, image_size: int = 32) -> Any:
    """CLIPProcessor with the released CLIP image settings (bicubic, OpenAI mean/std) at ``image_size``."""
    from transformers import CLIPImageProcessor, CLIPProcessor

    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def save_tiny_clip(directory: Path, hidden_act: str, seed: int = 0, image_size: int = 32) -> None:
    """Build a random tiny CLIPModel + processor and ``save_pretrained`` both into ``directory``."""
    import torch
    from transformers import CLIPModel

    torch.manual_seed(seed)
    tokenizer = clip_bpe_tokenizer()
    config = tiny_clip_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id, hidden_act,
                              image_size=image_size)
    CLIPModel(config).save_pretrained(str(directory))
    tiny_processor(tokenizer, image_size).save_pretrained(str(directory))


def tiny_clip_directory(name: str, hidden_act: str, seed: int = 0) -> Path:
    """The cached tiny checkpoint ``name`` (built on first use)."""
    target = cache_dir() / "presets" / f"{name}-tiny-v{TINY_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny_clip(tmp, hidden_act, seed))
