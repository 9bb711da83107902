"""Convert an open_clip CLIP checkpoint (the HPS v2 / v2.1 releases: ViT-H-14) to a transformers CLIPModel
directory, once:

    python -m omnirl_plugin_hpsv2.convert HPS_v2.1_compressed.pt hpsv2.1-clip/

The released .pt is a pickle: it is read with ``torch.load(..., weights_only=True)`` (tensors and plain
containers only, no code runs); a .safetensors input is read directly. The architecture is read from the
tensor shapes; the head counts, which shapes do not show, default to ViT-H-14's (16 and 16).

open_clip -> transformers: ``in_proj`` (q, k, v stacked) is split into ``q_proj``, ``k_proj``, ``v_proj``;
``visual.proj`` and ``text_projection`` (x @ P) become bias-free Linear layers (weight P^T); the text is
pooled at ``<|endoftext|>``, the highest id of the CLIP vocabulary (open_clip: ``argmax(ids)``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import torch

from omnirl_core.errors import UsageError

_BLOCK = {
    "ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
}


def read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    source = Path(source)
    if source.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(source))
    else:
        state = torch.load(str(source), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or "visual.conv1.weight" not in {k.removeprefix("module.") for k in state}:
        raise UsageError(f"'{source}' is not an open_clip CLIP state dict (no visual.conv1.weight).",
                         hint="Pass the released HPS_v2_compressed.pt or HPS_v2.1_compressed.pt.")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _layers(state: dict[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"resblocks\.(\d+)\.")
    return 1 + max(int(m.group(1)) for k in state if (m := pattern.match(k)))


def clip_config(state: dict[str, torch.Tensor], vision_heads: int = 16, text_heads: int = 16,
                hidden_act: str = "gelu") -> Any:
    """A transformers CLIPConfig read from the open_clip tensor shapes (ViT with class token)."""
    from transformers import CLIPConfig

    width, _, patch, _ = state["visual.conv1.weight"].shape
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    vocab, text_width = state["token_embedding.weight"].shape
    return CLIPConfig(
        vision_config={
            "hidden_size": width,
            "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": _layers(state, "visual.transformer."), "num_attention_heads": vision_heads,
            "image_size": grid * patch, "patch_size": patch, "hidden_act": hidden_act,
        },
        text_config={
            "hidden_size": text_width, "intermediate_size": state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": _layers(state, "transformer."), "num_attention_heads": text_heads,
            "vocab_size": vocab, "max_position_embeddings": state["positional_embedding"].shape[0],
            "hidden_act": hidden_act, "eos_token_id": vocab - 1, "bos_token_id": vocab - 2, "pad_token_id": vocab - 1,
        },
        projection_dim=state["text_projection"].shape[1],
    )


def _blocks(state: dict[str, torch.Tensor], src: str, dst: str, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(n):
        s, d = f"{src}resblocks.{i}.", f"{dst}layers.{i}."
        for name in ("weight", "bias"):
            q, k, v = state[f"{s}attn.in_proj_{name}"].chunk(3, dim=0)
            out[f"{d}self_attn.q_proj.{name}"] = q
            out[f"{d}self_attn.k_proj.{name}"] = k
            out[f"{d}self_attn.v_proj.{name}"] = v
            for a, b in _BLOCK.items():
                out[f"{d}{b}.{name}"] = state[f"{s}{a}.{name}"]
    return out


def to_transformers(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The CLIPModel state dict of an open_clip CLIP state dict."""
    v, t = "vision_model.", "text_model."
    out = {
        f"{v}embeddings.class_embedding": state["visual.class_embedding"],
        f"{v}embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        f"{v}embeddings.position_embedding.weight": state["visual.positional_embedding"],
        f"{v}pre_layrnorm.weight": state["visual.ln_pre.weight"], f"{v}pre_layrnorm.bias": state["visual.ln_pre.bias"],
        f"{v}post_layernorm.weight": state["visual.ln_post.weight"],
        f"{v}post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        f"{t}embeddings.token_embedding.weight": state["token_embedding.weight"],
        f"{t}embeddings.position_embedding.weight": state["positional_embedding"],
        f"{t}final_layer_norm.weight": state["ln_final.weight"], f"{t}final_layer_norm.bias": state["ln_final.bias"],
        "text_projection.weight": state["text_projection"].T,
        "logit_scale": state["logit_scale"].reshape(()),
        **_blocks(state, "visual.transformer.", f"{v}encoder.", config.vision_config.num_hidden_layers),
        **_blocks(state, "transformer.", f"{t}encoder.", config.text_config.num_hidden_layers),
    }
    return {k: x.detach().float().contiguous() for k, x in out.items()}


def convert(source: str | Path | dict[str, torch.Tensor], target: str | Path, vision_heads: int = 16,
            text_heads: int = 16) -> Path:
    """Write ``target``/config.json + model.safetensors (a transformers CLIPModel)."""
    from transformers import CLIPModel

    state = source if isinstance(source, dict) else read_state_dict(source)
    config = clip_config(state, vision_heads, text_heads)
    model = CLIPModel(config)
    missing, unexpected = model.load_state_dict(to_transformers(state, config), strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UsageError("The checkpoint does not map onto a CLIPModel.",
                         details=[f"missing: {missing[:8]}", f"unexpected: {unexpected[:8]}"])
    model.save_pretrained(str(target))
    return Path(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="open_clip checkpoint: .pt/.pth (read with weights_only=True) or .safetensors")
    parser.add_argument("target", help="directory to write (config.json, model.safetensors)")
    parser.add_argument("--vision-heads", type=int, default=16, help="image tower heads (ViT-H-14: 16)")
    parser.add_argument("--text-heads", type=int, default=16, help="text tower heads (ViT-H-14: 16)")
    args = parser.parse_args(argv)
    print(convert(args.source, args.target, args.vision_heads, args.text_heads))


if __name__ == "__main__":
    main()
