"""``geneval``: GenEval's compositional checks (object presence, count, colour, position) on an open-vocabulary
detector that transformers ships (OWLv2), so the GenEval task trains without mmdet.

Per image: OWLv2 is queried with "a photo of a {class}" for every class the prompt names; detections above
``threshold`` (``counting_threshold`` for counting prompts, as GenEval raises it) are kept, per-class NMS, at
most ``max_objects`` per class. Colours: each required object's box is cropped and classified by CLIP among
GenEval's ten colours ("a photo of a {colour} {class}"; GenEval also masks the background with the detector's
segmentation, which OWLv2 does not give). The rules are ``judge.judge``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from omnirl_core.contracts import Reward
from omnirl_core.rewards_kit.clip import DTYPES, from_pretrained, load_clip, resolve_device, to_uint8
from omnirl_core.rewards_kit.options import ModelRewardOptions
from omnirl_core.rewards_kit.tiny_clip import tiny_clip_directory
from omnirl_plugin_geneval.judge import Detection, judge
from omnirl_plugin_geneval.parse import COLORS, task_of

DEFAULT_DETECTOR = "google/owlv2-base-patch16-ensemble"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"
DEFAULT_PROMPTS = [
    "a photo of a red apple",
    "a photo of two cats",
    "a photo of a dog and a bicycle",
    "a photo of a cup left of a book",
    "a photo of a blue car and a yellow bench",
    "a photo of three bottles",
]


class GenEvalOptions(ModelRewardOptions):
    detector_path: str = Field(DEFAULT_DETECTOR, description="An OWLv2 checkpoint (transformers "
                               "Owlv2ForObjectDetection + processor): local directory or hub id.")
    clip_path: str = Field(DEFAULT_CLIP, description="The CLIP that classifies colours (GenEval: ViT-L/14): "
                           "local directory or hub id.")
    score: Literal["fraction", "strict"] = Field("fraction", description="fraction: the share of the prompt's "
                                                 "checks that hold; strict: 1 when all hold (GenEval's score).")
    threshold: float = Field(0.2, gt=0, lt=1, description="Detection confidence threshold (OWLv2's scale; not "
                             "calibrated against GenEval's Mask2Former 0.3).")
    counting_threshold: float = Field(0.35, gt=0, lt=1, description="Threshold for counting prompts (GenEval "
                                      "raises it to avoid double counts).")
    nms_iou: float = Field(0.5, gt=0, le=1, description="Per-class non-maximum suppression IoU (1: none).")
    max_objects: int = Field(16, ge=1, description="Most detections kept per class.")


def _iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of box a (4,) with boxes b (N, 4)."""
    lt, rb = torch.maximum(a[:2], b[:, :2]), torch.minimum(a[2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = lambda x: (x[..., 2] - x[..., 0]).clamp(min=0) * (x[..., 3] - x[..., 1]).clamp(min=0)
    return inter / (area(a) + area(b) - inter).clamp(min=1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou: float, limit: int) -> list[int]:
    """Indices kept by greedy NMS, most confident first, at most ``limit``."""
    order = scores.argsort(descending=True).tolist()
    keep: list[int] = []
    for i in order:
        if len(keep) == limit:
            break
        if not keep or bool((_iou(boxes[i], boxes[keep]) <= iou).all()) or iou >= 1:
            keep.append(i)
    return keep


def tiny_detector_directory(seed: int = 0) -> Path:
    from omnirl_core.presets import atomic_directory, cache_dir

    return atomic_directory(cache_dir() / "presets" / f"geneval-owlv2-tiny-v2-seed{seed}",
                            lambda tmp: save_tiny_owlv2(tmp, seed))


def save_tiny_owlv2(directory: Path, seed: int = 0, image_size: int = 64) -> None:
    """A random Owlv2ForObjectDetection (OWLv2's layout at small sizes) with its processor."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2Processor

    from omnirl_core.rewards_kit.tiny_clip import clip_bpe_tokenizer

    try:
        from transformers import Owlv2ImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4.x
        from transformers import Owlv2ImageProcessor as ImageProcessor
    torch.manual_seed(seed)
    tokenizer = clip_bpe_tokenizer()
    tokenizer.model_max_length = 16
    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    config = Owlv2Config(
        text_config={**common, "vocab_size": len(tokenizer), "max_position_embeddings": 16,
                     "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "pad_token_id": tokenizer.eos_token_id},
        vision_config={**common, "image_size": image_size, "patch_size": 8},
        projection_dim=32,  # OWLv2's class head compares text embeddings in the text width (512 = 512)
    )
    model = Owlv2ForObjectDetection(config)
    with torch.no_grad():  # confidences = sigmoid(cosine): spread over (0.27, 0.73) rather than saturated
        for layer in (model.class_head.logit_shift, model.class_head.logit_scale):
            layer.weight.zero_()
            layer.bias.zero_()
    model.save_pretrained(str(directory))
    processor = Owlv2Processor(image_processor=ImageProcessor(size={"height": image_size, "width": image_size}),
                               tokenizer=tokenizer)
    processor.save_pretrained(str(directory))


class GenEval(Reward):
    uses_inputs = True  # a record's GenEval metadata, when the prompts come with it

    def __init__(self, options: GenEvalOptions | None = None):
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        self.options = o = options or GenEvalOptions()
        detector, clip_path = o.detector_path, o.clip_path
        if o.preset == "tiny":
            detector, clip_path = str(tiny_detector_directory()), str(tiny_clip_directory("geneval", "quick_gelu"))
        self.device, dtype = resolve_device(o.device), DTYPES[o.dtype]
        label = "GenEval detector (OWLv2)"
        self.processor = from_pretrained(Owlv2Processor, detector, label, "detector_path", model=False,
                                         processor=True)
        self.detector = from_pretrained(Owlv2ForObjectDetection, detector, label, "detector_path", model=True,
                                        processor=False, dtype=dtype).to(self.device).eval().requires_grad_(False)
        self.clip = load_clip(clip_path, None, label="GenEval colour classifier (CLIP)", device=o.device,
                              dtype=o.dtype, option="clip_path")

    @torch.no_grad()
    def detect(self, image: torch.Tensor, classes: list[str], threshold: float) -> list[Detection]:
        from PIL import Image

        u8 = to_uint8(image)
        side = max(u8.shape[-2:])
        inputs = self.processor(text=[[f"a photo of a {c}" for c in classes]],
                                images=Image.fromarray(u8.permute(1, 2, 0).numpy()), return_tensors="pt")
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.detector.dtype)
        outputs = self.detector(**inputs)
        # OWLv2 pads to a square at the bottom and right: boxes in a (side, side) frame are image pixels
        result = self.processor.post_process_grounded_object_detection(
            outputs, threshold=threshold, target_sizes=[(side, side)])[0]
        boxes, scores, labels = result["boxes"].float().cpu(), result["scores"].float().cpu(), result["labels"].cpu()
        found = []
        for k, cls in enumerate(classes):
            idx = (labels == k).nonzero().flatten()
            for j in nms(boxes[idx], scores[idx], self.options.nms_iou, self.options.max_objects):
                found.append(Detection(cls, tuple(float(v) for v in boxes[idx[j]]), float(scores[idx[j]])))
        return found

    @torch.no_grad()
    def colors(self, image: torch.Tensor, cls: str, found: list[Detection]) -> list[str]:
        h, w = image.shape[-2:]
        crops = []
        for d in found:
            x0, y0 = min(max(int(d.box[0]), 0), w - 1), min(max(int(d.box[1]), 0), h - 1)
            x1, y1 = min(max(round(d.box[2]), x0 + 1), w), min(max(round(d.box[3]), y0 + 1), h)
            crops.append(image[:, y0:y1, x0:x1])
        text = F.normalize(self.clip.text_embeds([f"a photo of a {c} {cls}" for c in COLORS]), dim=-1)
        emb = F.normalize(self.clip.image_embeds(crops), dim=-1)
        return [COLORS[i] for i in (emb @ text.T).argmax(-1).tolist()]

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],
                 inputs: Sequence[Any] | None = None) -> list[float]:
        scores = []
        for i, (image, prompt) in enumerate(zip(outputs, prompts)):
            task = task_of(prompt, inputs[i] if inputs is not None else None)
            counting = task.tag == "counting" or any(w.count > 1 for w in task.include)
            threshold = self.options.counting_threshold if counting else self.options.threshold
            found = self.detect(image, task.classes, threshold)
            strict, fraction = judge(task, found, lambda cls, dets, img=image: self.colors(img, cls, dets))
            scores.append(float(strict) if self.options.score == "strict" else fraction)
        return scores
