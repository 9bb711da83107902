"""HPS v2: an open_clip ViT-H-14-layout checkpoint (tiny, random) converted to transformers scores like
open_clip's own forward. The reference here is open_clip's CLIP forward written out in plain torch from the
open_clip state dict (in_proj attention, causal text mask, argmax pooling, x @ proj) and hpsv2.score's
formula (diagonal of normalised image_features @ text_features.T); a second test runs the hpsv2 package's
own open_clip where it imports (it needs a working torchvision). Plus conversion, errors, offline, training."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omnirl_plugin_hpsv2.convert import convert
from omnirl_plugin_hpsv2.reward import HPSv2, HPSv2Options
from omnirl_plugin_hpsv2.tiny import OPEN_CLIP_FILE, TINY_HEADS, tiny_directory
from PIL import Image
from safetensors.torch import load_file
from transformers import CLIPModel, CLIPProcessor

from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import to_uint8
from omnirl_core.testing import check_reward_in_a_run, check_reward_rises, offline_error

PROMPTS = ["a lighthouse in a storm", "a corgi on a beach", "a lighthouse in a storm"]


def _images(h: int, w: int, n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for _ in range(n)]


def _block(x: torch.Tensor, sd: dict, p: str, heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    """open_clip ResidualAttentionBlock: x + attn(ln_1(x)), then x + mlp(ln_2(x)); (N, L, D)."""
    n, length, d = x.shape

    def ln(y: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(y, (d,), sd[f"{p}{name}.weight"], sd[f"{p}{name}.bias"], eps=1e-5)

    q, k, v = (ln(x, "ln_1") @ sd[f"{p}attn.in_proj_weight"].T + sd[f"{p}attn.in_proj_bias"]).chunk(3, dim=-1)
    q, k, v = (t.reshape(n, length, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    logits = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    if mask is not None:
        logits = logits + mask
    attn = (logits.softmax(-1) @ v).transpose(1, 2).reshape(n, length, d)
    x = x + attn @ sd[f"{p}attn.out_proj.weight"].T + sd[f"{p}attn.out_proj.bias"]
    h = F.gelu(ln(x, "ln_2") @ sd[f"{p}mlp.c_fc.weight"].T + sd[f"{p}mlp.c_fc.bias"])  # ViT-H-14: exact GELU
    return x + h @ sd[f"{p}mlp.c_proj.weight"].T + sd[f"{p}mlp.c_proj.bias"]


def open_clip_encode_image(sd: dict, pixels: torch.Tensor, heads: int) -> torch.Tensor:
    conv = sd["visual.conv1.weight"]
    x = F.conv2d(pixels, conv, stride=conv.shape[-1]).flatten(2).transpose(1, 2)  # (N, grid^2, width)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    x = F.layer_norm(x, x.shape[-1:], sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    layers = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith("visual.transformer.resblocks."))
    for i in range(layers):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}.", heads, None)
    x = F.layer_norm(x[:, 0], x.shape[-1:], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
    return x @ sd["visual.proj"]


def open_clip_encode_text(sd: dict, ids: torch.Tensor, heads: int) -> torch.Tensor:
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    length = ids.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)  # open_clip build_attention_mask
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("transformer.resblocks."))
    for i in range(layers):
        x = _block(x, sd, f"transformer.resblocks.{i}.", heads, mask)
    x = F.layer_norm(x, x.shape[-1:], sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(x.shape[0]), ids.argmax(dim=-1)] @ sd["text_projection"]


def open_clip_ids(tokenizer, texts: list[str], context: int = 77) -> torch.Tensor:
    """open_clip.tokenize's layout: sot, tokens, eot, zero padding to the context length."""
    out = torch.zeros(len(texts), context, dtype=torch.long)
    for i, ids in enumerate(tokenizer(texts, truncation=True, max_length=context)["input_ids"]):
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def preprocess_val(image: Image.Image, size: int = 32) -> torch.Tensor:
    """hpsv2's image_transform(size, is_train=False) on one PIL image: ToTensor, Resize(size, bicubic) on the
    float tensor (torchvision: antialiased interpolate), CenterCrop (offsets rounded), Normalize (OpenAI)."""
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float().div(255)
    h, w = x.shape[-2:]
    short, long = min(h, w), max(h, w)
    new = (size, int(size * long / short)) if h <= w else (int(size * long / short), size)
    x = F.interpolate(x[None], size=new, mode="bicubic", antialias=True, align_corners=False)[0]
    top, left = round((new[0] - size) / 2.0), round((new[1] - size) / 2.0)
    x = x[:, top:top + size, left:left + size]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    return (x - mean) / std


def reference_hps(directory: Path, outputs: list[torch.Tensor], prompts: list[str]) -> np.ndarray:
    sd = load_file(str(directory / OPEN_CLIP_FILE))
    tokenizer = CLIPProcessor.from_pretrained(str(directory)).tokenizer
    pixels = torch.stack([preprocess_val(Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy())) for x in outputs])
    with torch.no_grad():
        image = F.normalize(open_clip_encode_image(sd, pixels, TINY_HEADS), dim=-1)
        text = F.normalize(open_clip_encode_text(sd, open_clip_ids(tokenizer, prompts), TINY_HEADS), dim=-1)
    return torch.diagonal(image @ text.T).numpy()  # hpsv2.score: diagonal(image_features @ text_features.T)


@pytest.fixture(scope="module")
def tiny() -> HPSv2:
    return HPSv2(HPSv2Options(preset="tiny", device="cpu"))


@pytest.mark.parametrize("size", [(32, 32), (40, 56), (64, 64), (33, 47)])
def test_converted_model_scores_like_open_clip(tiny: HPSv2, size: tuple[int, int]):
    outputs = _images(*size)
    expected = reference_hps(tiny_directory(), outputs, PROMPTS)
    got = np.asarray(tiny(outputs, PROMPTS))
    assert np.abs(got - expected).max() <= 1e-5, (got, expected)
    assert got[0] != got[2]  # same prompt, other image


def test_against_the_hpsv2_package(tiny: HPSv2):
    """hpsv2's own open_clip (model + preprocess_val) on the same tiny weights. Needs hpsv2 and a
    torchvision that imports; skipped where either is missing (a CPU-only torch with the PyPI torchvision
    fails with RuntimeError; hpsv2 1.2.0's wheel lacks bpe_simple_vocab_16e6.txt.gz: FileNotFoundError)."""
    try:
        from hpsv2.src import open_clip
    except (ImportError, OSError, RuntimeError) as exc:
        pytest.skip(f"hpsv2's open_clip does not import here: {type(exc).__name__}: {exc}")
    directory = tiny_directory()
    sd = load_file(str(directory / OPEN_CLIP_FILE))
    tokenizer = CLIPProcessor.from_pretrained(str(directory)).tokenizer
    model = open_clip.model.CLIP(
        embed_dim=sd["visual.proj"].shape[1],
        vision_cfg={"image_size": 32, "layers": 2, "width": 32, "head_width": 32 // TINY_HEADS, "patch_size": 8},
        text_cfg={"context_length": 77, "vocab_size": len(tokenizer), "width": 32, "heads": TINY_HEADS, "layers": 2},
        output_dict=True,
    )
    model.load_state_dict(sd, strict=True)
    model.eval()
    transform = open_clip.image_transform(32, is_train=False)
    for size in [(32, 32), (40, 56), (64, 64)]:
        outputs = _images(*size)
        pil = [Image.fromarray(to_uint8(x).permute(1, 2, 0).numpy()) for x in outputs]
        with torch.no_grad():
            out = model(torch.stack([transform(p) for p in pil]), open_clip_ids(tokenizer, PROMPTS))
            expected = torch.diagonal(out["image_features"] @ out["text_features"].T).numpy()
        assert np.abs(np.asarray(tiny(outputs, PROMPTS)) - expected).max() <= 1e-5, size


def test_conversion_reads_the_released_pickle_layout_with_weights_only(tmp_path: Path):
    """The release is {'state_dict': ...} (DDP 'module.' prefixes possible) in a .pt: same model."""
    sd = load_file(str(tiny_directory() / OPEN_CLIP_FILE))
    torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}, "epoch": 1}, tmp_path / "hps.pt")
    convert(tmp_path / "hps.pt", tmp_path / "out", vision_heads=TINY_HEADS, text_heads=TINY_HEADS)
    a = CLIPModel.from_pretrained(str(tmp_path / "out")).state_dict()
    b = CLIPModel.from_pretrained(str(tiny_directory())).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.save({"state_dict": {"layers.0.weight": torch.zeros(2, 2)}}, tmp_path / "other.pt")
    with pytest.raises(UsageError, match="not an open_clip CLIP state dict"):
        convert(tmp_path / "other.pt", tmp_path / "other")


def test_tiny_preset_and_contract(tiny: HPSv2):
    model = CLIPModel.from_pretrained(str(tiny_directory()))
    assert model.config.vision_config.hidden_act == "gelu"
    assert model.config.text_config.eos_token_id == model.config.text_config.vocab_size - 1
    from omnirl_core.testing import check_reward

    scores = check_reward(tiny, _images(32, 32, n=2), ["a red square", "a blue sky"])
    assert all(-1 <= s <= 1 for s in scores)  # a cosine: hpsv2.score applies no logit scale


def test_unset_path_and_missing_files(tmp_path: Path):
    with pytest.raises(UsageError) as err:
        HPSv2(HPSv2Options(device="cpu"))
    assert "path is not set" in err.value.message
    assert "xswu/HPSv2" in err.value.render() and "python -m omnirl_plugin_hpsv2.convert" in err.value.render()
    with pytest.raises(UsageError) as err:
        HPSv2(HPSv2Options(path=str(tmp_path), processor_path=str(tmp_path), device="cpu"))
    assert "config.json, model.safetensors, preprocessor_config.json" in err.value.message
    assert f"Put them in {tmp_path}" in err.value.render()


def test_hf_hub_offline_never_touches_the_network():
    """A converted model on disk, the default processor hub id not cached: refused without a connection."""
    out = offline_error('from omnirl_plugin_hpsv2.reward import HPSv2, HPSv2Options',
                        f"HPSv2(HPSv2Options(path={str(tiny_directory())!r}, device='cpu'))")
    assert "preprocessor_config.json, tokenizer.json | vocab.json + merges.txt missing for " \
           "'laion/CLIP-ViT-H-14-laion2B-s32B-b79K'" in out
    assert "HF_HUB_OFFLINE=1 is set" in out and "processor_path" in out


@pytest.mark.slow
def test_a_tiny_training_run_scores_with_the_reward(tmp_path: Path):
    check_reward_in_a_run(tmp_path / "run", "hpsv2", "--set", "rewards.0.options.preset=tiny",
                          "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")


@pytest.mark.slow
@pytest.mark.long
def test_tiny_training_run_raises_the_reward(tmp_path: Path):
    check_reward_rises(tmp_path / "run", "hpsv2", 60, "--set", "rewards.0.options.preset=tiny",
                       "--set", "rewards.0.options.device=cpu", model="qwen-image", algo="flowgrpo")
