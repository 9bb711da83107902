"""One-time conversion of the released ImageReward checkpoint to transformers' BLIP layout (safetensors).

    python -m omnirl_plugin_imagereward.convert ImageReward.pt med_config.json BERT_TOKENIZER_DIR OUT_DIR

``ImageReward.pt`` and ``med_config.json`` are in the hub repo THUDM/ImageReward; BERT_TOKENIZER_DIR holds
bert-base-uncased's tokenizer (``hf download bert-base-uncased --local-dir DIR``), to which BLIP adds ``[DEC]``
and ``[ENC]``. The .pt is read with ``torch.load(weights_only=True)`` (tensors only, no code runs).

Key map: BLIP's timm ViT ``blip.visual_encoder.*`` -> ``vision.*`` (BlipVisionModel: cls_token ->
embeddings.class_embedding, pos_embed -> embeddings.position_embedding, patch_embed.proj ->
embeddings.patch_embedding, blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp} -> encoder.layers.i.{layer_norm1,
self_attn.qkv, self_attn.projection, layer_norm2, mlp}, norm -> post_layernorm); ``blip.text_encoder.*`` ->
``text.*`` (BlipTextModel is BLIP's med.py BertModel: same names); ``mlp.layers.*`` -> ``mlp.layers.*``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

WEIGHTS = "model.safetensors"
CONFIG = "imagereward_config.json"
_VISION = [(r"^cls_token$", "embeddings.class_embedding"), (r"^pos_embed$", "embeddings.position_embedding"),
           (r"^patch_embed\.proj\.", "embeddings.patch_embedding."), (r"^norm\.", "post_layernorm."),
           (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
           (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
           (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
           (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
           (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp.")]


def convert_state(state: dict[str, Any]) -> dict[str, Any]:
    """The release's state dict -> {vision.*, text.*, mlp.*} in transformers' names (other heads dropped)."""
    out = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder."):]
            for pattern, repl in _VISION:
                if re.match(pattern, name):
                    out["vision." + re.sub(pattern, repl, name)] = value
                    break
            else:
                raise ValueError(f"unexpected vision key {key}")
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text." + key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
    if not any(k.startswith("mlp.") for k in out) or "vision.embeddings.class_embedding" not in out:
        raise ValueError("not an ImageReward checkpoint (no mlp.layers.* or blip.visual_encoder.cls_token)")
    return out


def configs(state: dict[str, Any], med: dict[str, Any], vision_heads: int) -> dict[str, Any]:
    """BlipVisionConfig / BlipTextConfig arguments read off the shapes (and med_config.json for the text)."""
    width = state["vision.embeddings.class_embedding"].shape[-1]
    patch = state["vision.embeddings.patch_embedding.weight"].shape[-1]
    positions = state["vision.embeddings.position_embedding"].shape[1]
    layers = 1 + max(int(k.split(".")[3]) for k in state if k.startswith("vision.encoder.layers."))
    vision = {"hidden_size": width, "intermediate_size": state["vision.encoder.layers.0.mlp.fc1.weight"].shape[0],
              "num_hidden_layers": layers, "num_attention_heads": vision_heads, "patch_size": patch,
              "image_size": patch * round((positions - 1) ** 0.5), "layer_norm_eps": 1e-6, "hidden_act": "gelu"}
    text = {"vocab_size": med["vocab_size"], "hidden_size": med["hidden_size"],
            "intermediate_size": med["intermediate_size"], "num_hidden_layers": med["num_hidden_layers"],
            "num_attention_heads": med["num_attention_heads"], "max_position_embeddings": med["max_position_embeddings"],
            "layer_norm_eps": med.get("layer_norm_eps", 1e-12), "hidden_act": med.get("hidden_act", "gelu"),
            "encoder_hidden_size": width, "pad_token_id": med.get("pad_token_id", 0),
            "bos_token_id": med.get("bos_token_id", 30522)}  # BLIP's added [DEC]
    return {"vision": vision, "text": text, "image_size": vision["image_size"]}


def save_tokenizer(bert_dir: str | Path, target: Path, max_length: int = 35) -> None:
    """bert-base-uncased's tokenizer with BLIP's added [DEC] (bos) and [ENC] tokens (``init_tokenizer``)."""
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizerFast.from_pretrained(str(bert_dir))
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(target))


def convert(source: str | Path, med_config: str | Path, bert_dir: str | Path, target: str | Path,
            vision_heads: int = 16) -> Path:
    import torch
    from safetensors.torch import save_file

    if str(source).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(str(source))
    else:
        state = torch.load(str(source), map_location="cpu", weights_only=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    converted = {k: v.detach().float().contiguous() for k, v in convert_state(state).items()}
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    med = json.loads(Path(med_config).read_text())
    (target / CONFIG).write_text(json.dumps(configs(converted, med, vision_heads), indent=1))
    save_file(converted, str(target / WEIGHTS))
    save_tokenizer(bert_dir, target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="ImageReward.pt")
    parser.add_argument("med_config", help="med_config.json")
    parser.add_argument("bert_tokenizer", help="a directory with bert-base-uncased's tokenizer")
    parser.add_argument("target", help="the directory to write")
    args = parser.parse_args(argv)
    print(convert(args.source, args.med_config, args.bert_tokenizer, args.target))


if __name__ == "__main__":
    main()
