"""ImageReward (Xu et al. 2023): r(x, y) = (MLP(h_CLS) - mu) / sigma, mu = 0.16717362830052426,
sigma = 1.0333394966054072, where h_CLS is the [CLS] output of BLIP's image-grounded text encoder (BERT with
cross-attention to the BLIP ViT-L/16 image tokens) on the prompt, tokenised to 35 tokens (padded).

Run on transformers' BlipVisionModel + BlipTextModel from the release converted once to safetensors
(``python -m omnirl_plugin_imagereward.convert``); images preprocessed as the release (Resize(224, bicubic)
on the 8-bit picture, CenterCrop(224), CLIP mean/std).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import nn

from omnirl_core.contracts import Reward
from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import DTYPES, ClipPreprocessor, hub_offline, resolve_device
from omnirl_core.rewards_kit.options import BatchedRewardOptions
from omnirl_plugin_imagereward.convert import CONFIG, WEIGHTS

MEAN, STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
CONVERT = "python -m omnirl_plugin_imagereward.convert ImageReward.pt med_config.json BERT_TOKENIZER_DIR DIR"
DEFAULT_PROMPTS = [
    "a serene japanese garden with a koi pond, highly detailed",
    "a portrait of an old fisherman, dramatic lighting",
    "a cozy reading nook with a cat, warm colors",
    "a futuristic train station, concept art",
    "a bowl of fresh fruit on a marble table, photo",
    "a dragon flying over snowy mountains, fantasy illustration",
]


class ImageRewardOptions(BatchedRewardOptions):
    path: str | None = Field(None, description=f"The converted ImageReward directory (written by `{CONVERT}`).")
    batch_size: int = Field(16, ge=1, description="Images per forward pass.")


class Head(nn.Module):
    """The release's MLP: Linear(d, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
    Linear(64, 16), Linear(16, 1), no activations."""

    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _check(directory: Path) -> None:
    missing = [f for f in (WEIGHTS, CONFIG, "tokenizer.json") if not (directory / f).is_file()]
    if missing:
        where = "" if directory.is_dir() else " (the directory does not exist)"
        raise UsageError(
            f"ImageReward: {', '.join(missing)} missing in {directory}{where}.",
            details=[("Download ImageReward.pt and med_config.json (hub repo THUDM/ImageReward) and "
                      "bert-base-uncased's tokenizer, then convert once (weights_only=True, no code runs):"),
                     "  " + CONVERT] + (["HF_HUB_OFFLINE=1 is set: nothing is downloaded."] if hub_offline() else []),
            hint=f"Write the converted files to {directory} (or point rewards.<i>.options.path at them), or use "
                 "preset=tiny.")


class ImageRewardScore(Reward):
    def __init__(self, options: ImageRewardOptions | None = None):
        from safetensors.torch import load_file
        from transformers import (
            BertTokenizerFast,
            BlipTextConfig,
            BlipTextModel,
            BlipVisionConfig,
            BlipVisionModel,
        )

        self.options = o = options or ImageRewardOptions()
        if o.preset == "tiny":
            from omnirl_plugin_imagereward.tiny import tiny_directory

            directory = tiny_directory()
        elif o.path is None:
            raise UsageError("The imagereward reward needs a converted checkpoint: rewards.<i>.options.path is not set.",
                             details=["Convert the release once:", "  " + CONVERT],
                             hint="Set rewards.<i>.options.path=DIR (or use preset=tiny).")
        else:
            directory = Path(o.path).expanduser()
        _check(directory)
        config = json.loads((directory / CONFIG).read_text())
        state = load_file(str(directory / WEIGHTS))
        self.vision = BlipVisionModel(BlipVisionConfig(**config["vision"]))
        self.text = BlipTextModel(BlipTextConfig(**config["text"]), add_pooling_layer=False)
        self.head = Head(config["text"]["hidden_size"])
        for prefix, module in (("vision.", self.vision), ("text.", self.text), ("mlp.", self.head)):
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if prefix == "mlp.":
                part = {"layers." + k[len("layers."):]: v for k, v in part.items()}
            missing, unexpected = module.load_state_dict(part, strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise UsageError(f"ImageReward: {directory / WEIGHTS} does not match its config "
                                 f"({prefix}*: missing {missing[:4]}, unexpected {unexpected[:4]}).",
                                 hint="Convert the release again with: " + CONVERT)
        self.device, dtype = resolve_device(o.device), DTYPES[o.dtype]
        self.vision.to(self.device, dtype).eval().requires_grad_(False)
        self.text.to(self.device, dtype).eval().requires_grad_(False)
        self.head.to(self.device).eval().requires_grad_(False)
        self.tokenizer = BertTokenizerFast.from_pretrained(str(directory))
        size = config["image_size"]
        self.preprocess = ClipPreprocessor(
            shortest_edge=size, size_hw=None, crop_hw=(size, size), rescale=1 / 255,
            mean=torch.tensor(CLIP_MEAN).view(3, 1, 1), std=torch.tensor(CLIP_STD).view(3, 1, 1),
            resize_on="uint8", round_crop=True)  # torchvision Resize on the PIL image, CenterCrop rounds

    @torch.no_grad()
    def _scores(self, outputs: Sequence[Any], prompts: Sequence[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=35,
                                return_tensors="pt").to(self.device)
        pixels = self.preprocess(outputs).to(self.device, self.vision.dtype)
        image = self.vision(pixel_values=pixels).last_hidden_state
        text = self.text(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                         encoder_hidden_states=image,
                         encoder_attention_mask=torch.ones(image.shape[:-1], dtype=torch.long, device=self.device))
        cls = text.last_hidden_state[:, 0, :].float()
        return ((self.head(cls) - MEAN) / STD).squeeze(-1)  # the release's score

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        size = self.options.batch_size
        return torch.cat([self._scores(outputs[i:i + size], prompts[i:i + size])
                          for i in range(0, len(outputs), size)]).tolist()
