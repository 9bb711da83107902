"""ImageReward's scores by the release's own code, for the equivalence test. Run it with a Python that has the
``image-reward`` package (it does not install next to omnirl; see the README):

    IMAGEREWARD_PYTHON=/path/to/venv/bin/python pytest plugins/rewards/imagereward/tests
    /path/to/venv/bin/python imagereward_reference.py CHECKPOINT_DIR IMAGES.npz OUT.json

The text encoder is the package's ``ImageReward/models/BLIP/med.py`` BertModel, loaded from the original-layout
state dict (strict). The package's ``ImageReward.py`` and ``vit.py`` import torchvision / timm at module level,
so the steps of ``ImageReward.score`` around the text encoder are written out here from the release:
init_tokenizer (bert + [DEC] + [ENC]), the tokenizer call (max_length 35, padded), the transform (Resize bicubic
on the PIL image, CenterCrop with rounded offsets, ToTensor, CLIP mean/std), timm's ViT forward (pre-norm
blocks, qkv attention, exact GELU, LayerNorm eps 1e-6, all tokens after the final norm), the [CLS] feature, the
MLP and (r - mean) / std.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image


def load_med():
    spec = importlib.util.find_spec("ImageReward")
    root = Path(spec.submodule_search_locations[0])
    med_spec = importlib.util.spec_from_file_location("imagereward_med", root / "models" / "BLIP" / "med.py")
    med = importlib.util.module_from_spec(med_spec)
    med_spec.loader.exec_module(med)
    return med


def vit(sd: dict, pixels: torch.Tensor, heads: int) -> torch.Tensor:
    p = "blip.visual_encoder."
    x = F.conv2d(pixels, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"],
                 stride=sd[p + "patch_embed.proj.weight"].shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[p + "cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + sd[p + "pos_embed"]
    n, length, d = x.shape
    layers = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith(p + "blocks."))
    for i in range(layers):
        b = f"{p}blocks.{i}."
        h = F.layer_norm(x, (d,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], eps=1e-6)
        qkv = (h @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"]).reshape(n, length, 3, heads, d // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (d // heads) ** -0.5).softmax(-1)
        h = (attn @ v).transpose(1, 2).reshape(n, length, d)
        x = x + h @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        h = F.layer_norm(x, (d,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], eps=1e-6)
        h = F.gelu(h @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"])
        x = x + h @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    return F.layer_norm(x, (d,), sd[p + "norm.weight"], sd[p + "norm.bias"], eps=1e-6)


def transform(image: np.ndarray, n_px: int) -> torch.Tensor:
    """torchvision's Resize(n_px, BICUBIC) on a PIL image, CenterCrop(n_px), ToTensor, Normalize."""
    pil = Image.fromarray(image)
    w, h = pil.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = n_px, int(n_px * long / short)
    size = (new_short, new_long) if w <= h else (new_long, new_short)
    if size != (w, h):
        pil = pil.resize(size, Image.BICUBIC)
    w, h = pil.size
    top, left = round((h - n_px) / 2.0), round((w - n_px) / 2.0)  # torchvision: int(round(.))
    pil = pil.crop((left, top, left + n_px, top + n_px))
    x = torch.from_numpy(np.asarray(pil.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)
    return (x - mean) / std


def main(checkpoint: str, images_npz: str, out: str) -> None:
    from safetensors.torch import load_file
    from transformers import BertTokenizer

    directory = Path(checkpoint)
    sd = load_file(str(directory / "imagereward_original.safetensors"))
    med = load_med()
    config = med.BertConfig.from_json_file(str(directory / "med_config.json"))
    text_encoder = med.BertModel(config=config, add_pooling_layer=False).eval()
    text_encoder.load_state_dict({k[len("blip.text_encoder."):]: v for k, v in sd.items()
                                  if k.startswith("blip.text_encoder.")}, strict=False)
    missing = [k for k in text_encoder.state_dict() if "blip.text_encoder." + k not in sd and "position_ids" not in k]
    assert not missing, missing
    tokenizer = BertTokenizer.from_pretrained(str(directory / "bert-tokenizer"))  # init_tokenizer
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    data = np.load(images_npz)
    prompts = json.loads(str(data["prompts"]))
    heads = json.loads((directory / "imagereward_config.json").read_text())["vision"]["num_attention_heads"]
    n_px = json.loads((directory / "imagereward_config.json").read_text())["image_size"]
    scores = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            text_input = tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
            image_embeds = vit(sd, transform(data[f"image{i}"], n_px)[None], heads)
            image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long)
            text_output = text_encoder(text_input.input_ids, attention_mask=text_input.attention_mask,
                                       encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                       return_dict=True)
            x = text_output.last_hidden_state[:, 0, :].float()
            for layer in (0, 2, 4, 6, 7):  # the MLP (dropouts are identities in eval)
                x = x @ sd[f"mlp.layers.{layer}.weight"].T + sd[f"mlp.layers.{layer}.bias"]
            scores.append(float((x - 0.16717362830052426) / 1.0333394966054072))
    Path(out).write_text(json.dumps({"scores": scores, "transformers": __import__("transformers").__version__,
                                     "med_py": str(Path(med.__file__))}))
    assert all(math.isfinite(s) for s in scores)


if __name__ == "__main__":
    main(*sys.argv[1:4])
