"""The ``tiny`` preset: a random checkpoint in the release's layout (BLIP's timm ViT, med.py BERT with
cross-attention, the MLP head) at small sizes, with a small BERT WordPiece tokenizer, converted by the same
``convert`` a release goes through."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omnirl_core.presets import atomic_directory, cache_dir, corpus_characters, corpus_words
from omnirl_plugin_imagereward.convert import convert

ORIGINAL = "imagereward_original.safetensors"
MED_CONFIG = "med_config.json"
TINY = {"width": 32, "layers": 2, "heads": 2, "patch": 8, "image_size": 32, "text_width": 32, "text_layers": 2,
        "text_heads": 2}


def bert_tokenizer(directory: Path, vocab_size: int = 400) -> Any:
    """A BERT-style WordPiece tokenizer (lower case, [CLS] ... [SEP], [PAD] = 0) over the small corpus. The
    vocabulary is built, not trained (``tokenizers``' WordPiece trainer breaks ties in a per-process hash
    order, so two machines got different vocabularies): the specials, every printable character, its ``##``
    continuation, and every corpus word."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    characters = [c for c in corpus_characters() if c == c.lower()]
    pieces = specials + characters + ["##" + c for c in characters] + [w for w in corpus_words() if len(w) > 1]
    if len(pieces) > vocab_size:
        raise ValueError(f"bert_tokenizer: the small corpus needs {len(pieces)} pieces, more than {vocab_size}")
    tk = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tk.token_to_id("[CLS]")), ("[SEP]", tk.token_to_id("[SEP]"))])
    tokenizer = BertTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                  cls_token="[CLS]", mask_token="[MASK]")
    tokenizer.save_pretrained(str(directory))
    # vocab.txt too, as bert-base-uncased ships it (BLIP's slow BertTokenizer reads it)
    (directory / "vocab.txt").write_text("".join(p + "\n" for p in pieces))
    return tokenizer


def random_original_state(vocab_size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict with the release's keys, med_config) at the TINY sizes, random weights."""
    from transformers import BlipTextConfig, BlipTextModel

    t = TINY
    g = torch.Generator().manual_seed(seed)

    def n(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w, grid = t["width"], t["image_size"] // t["patch"]
    state = {"blip.visual_encoder.cls_token": n(1, 1, w), "blip.visual_encoder.pos_embed": n(1, grid * grid + 1, w),
             "blip.visual_encoder.patch_embed.proj.weight": n(w, 3, t["patch"], t["patch"]),
             "blip.visual_encoder.patch_embed.proj.bias": n(w),
             "blip.visual_encoder.norm.weight": 1 + n(w), "blip.visual_encoder.norm.bias": n(w)}
    for i in range(t["layers"]):
        p = f"blip.visual_encoder.blocks.{i}."
        state |= {f"{p}norm1.weight": 1 + n(w), f"{p}norm1.bias": n(w), f"{p}norm2.weight": 1 + n(w),
                  f"{p}norm2.bias": n(w), f"{p}attn.qkv.weight": n(3 * w, w, std=w ** -0.5),
                  f"{p}attn.qkv.bias": n(3 * w), f"{p}attn.proj.weight": n(w, w, std=w ** -0.5),
                  f"{p}attn.proj.bias": n(w), f"{p}mlp.fc1.weight": n(4 * w, w, std=w ** -0.5),
                  f"{p}mlp.fc1.bias": n(4 * w), f"{p}mlp.fc2.weight": n(w, 4 * w, std=(4 * w) ** -0.5),
                  f"{p}mlp.fc2.bias": n(w)}
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": t["text_width"], "initializer_range": 0.02,
           "intermediate_size": 4 * t["text_width"], "layer_norm_eps": 1e-12, "max_position_embeddings": 64,
           "model_type": "bert", "num_attention_heads": t["text_heads"], "num_hidden_layers": t["text_layers"],
           "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": vocab_size, "encoder_width": w,
           "add_cross_attention": True, "bos_token_id": vocab_size - 2}
    # med.py's BertModel and transformers' BlipTextModel share their parameter names: take the names (and
    # shapes) from the latter, the values from the generator
    names = BlipTextModel(BlipTextConfig(vocab_size=vocab_size, hidden_size=t["text_width"],
                                         intermediate_size=4 * t["text_width"], num_hidden_layers=t["text_layers"],
                                         num_attention_heads=t["text_heads"], max_position_embeddings=64,
                                         bos_token_id=vocab_size - 2,
                                         encoder_hidden_size=w), add_pooling_layer=False).state_dict()
    for key, value in names.items():
        if key.endswith("position_ids"):
            continue
        state[f"blip.text_encoder.{key}"] = (1 + n(*value.shape)) if "LayerNorm.weight" in key else n(*value.shape)
    dims = [t["text_width"], 1024, 128, 64, 16, 1]
    for i, layer in enumerate((0, 2, 4, 6, 7)):
        state[f"mlp.layers.{layer}.weight"] = n(dims[i + 1], dims[i], std=1 / (dims[i] + 1) ** 0.5)
        state[f"mlp.layers.{layer}.bias"] = n(dims[i + 1])
    return state, med


def save_tiny(directory: Path, seed: int = 0) -> None:
    from safetensors.torch import save_file

    bert_dir = directory / "bert-tokenizer"
    tokenizer = bert_tokenizer(bert_dir)
    state, med = random_original_state(len(tokenizer) + 2, seed)  # + [DEC], [ENC]
    save_file(state, str(directory / ORIGINAL))
    (directory / MED_CONFIG).write_text(json.dumps(med, indent=1))
    convert(directory / ORIGINAL, directory / MED_CONFIG, bert_dir, directory, vision_heads=TINY["heads"])


def tiny_directory(seed: int = 0) -> Path:
    return atomic_directory(cache_dir() / "presets" / f"imagereward-tiny-v2-seed{seed}", lambda tmp: save_tiny(tmp, seed))
