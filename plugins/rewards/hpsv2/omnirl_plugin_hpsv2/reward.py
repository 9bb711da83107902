"""HPS v2 / v2.1 (Wu et al. 2023): an open_clip ViT-H-14 fine-tuned on human preferences (HPD v2).

score = cos(E_img(y), E_txt(x)): ``hpsv2.score`` takes the diagonal of ``image_features @ text_features.T``
with both L2-normalised by the model (no logit scale). The released open_clip checkpoint is converted once
to a transformers CLIPModel (``python -m omnirl_plugin_hpsv2.convert``) and run with the processor of
laion/CLIP-ViT-H-14-laion2B-s32B-b79K (the same tokenizer and image settings as open_clip's ViT-H-14).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.errors import UsageError
from omnirl_core.rewards_kit.clip import cosine, load_clip
from omnirl_core.rewards_kit.options import BatchedRewardOptions

DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CONVERT = "python -m omnirl_plugin_hpsv2.convert HPS_v2.1_compressed.pt DIR"
DEFAULT_PROMPTS = [
    "a painting of a lighthouse in a storm, dramatic lighting",
    "a cute corgi wearing sunglasses on a beach",
    "a futuristic city at night, concept art",
    "a still life of fruit in a bowl, oil on canvas",
    "an anime girl reading a book under a cherry tree",
    "a photo of a mountain lake at sunrise",
]


class HPSv2Options(BatchedRewardOptions):
    path: str | None = Field(None, description="The converted HPS v2/v2.1 checkpoint (a transformers CLIPModel "
                             f"directory written by `{CONVERT}`).")
    processor_path: str = Field(DEFAULT_PROCESSOR, description="The ViT-H-14 CLIPProcessor: a local directory "
                                "or a hub id.")


class HPSv2(Reward):
    def __init__(self, options: HPSv2Options | None = None):
        self.options = o = options or HPSv2Options()
        if o.preset == "tiny":
            from omnirl_plugin_hpsv2.tiny import tiny_directory

            path, processor = str(tiny_directory()), None
        elif o.path is None:
            raise UsageError(
                "The hpsv2 reward needs a converted HPS checkpoint: rewards.<i>.options.path is not set.",
                details=[("Download HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt) from the hub repo "
                          "xswu/HPSv2, then convert it once (weights_only=True, no code runs):"), "  " + CONVERT],
                hint="Set rewards.<i>.options.path=DIR (or use preset=tiny).",
            )
        else:
            path, processor = o.path, o.processor_path
        # hpsv2's preprocess_val: ToTensor, then torchvision's bicubic resize on floats, CenterCrop, Normalize
        # and open_clip's tokenizer, which reads special-token strings ('!', laion's HF pad token) as text
        self.clip = load_clip(path, processor, label="HPS v2", device=o.device, dtype=o.dtype, resize_on="float",
                              split_special_tokens=True)

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str]) -> list[float]:
        return cosine(self.clip, outputs, list(prompts), self.options.batch_size).tolist()
