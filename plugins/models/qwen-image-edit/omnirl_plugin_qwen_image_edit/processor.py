"""The vision-language inputs of Qwen-Image-Edit's text encoder: what ``Qwen2VLProcessor`` does for images and text.

The released checkpoints' ``processor`` is a ``Qwen2VLProcessor``, whose construction needs torchvision (its video
processor). Editing needs only its image part, which builds anywhere: the image processor (the checkpoint's own
``processor/preprocessor_config.json``, read by ``Qwen2VLImageProcessorPil``), the tokenizer, and the expansion of
each ``<|image_pad|>`` to one token per merged vision patch. The pipeline is handed this object as its
``processor`` (a ``ProcessorMixin``, the type diffusers checks), so diffusers' own pipeline and this plugin's model
see the very same inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import BatchFeature, ProcessorMixin

IMAGE_TOKEN = "<|image_pad|>"


class QwenVLInputs(ProcessorMixin):
    """``processor(text=[...], images=[...], padding=True, return_tensors="pt")`` as ``Qwen2VLProcessor`` answers it
    (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``), without a video processor."""

    def __init__(self, image_processor: Any, tokenizer: Any):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = None

    def __call__(self, text: list[str] | str, images: Any = None, padding: bool = True,  # type: ignore[override]
                 return_tensors: str = "pt", **kwargs: Any) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text)
        features: dict[str, Any] = {}
        if images is not None and (not isinstance(images, list) or images):
            features = dict(self.image_processor(images=images, return_tensors=return_tensors))
            merge = self.image_processor.merge_size ** 2
            counts = iter((features["image_grid_thw"].prod(-1) // merge).tolist())
            for i, t in enumerate(texts):  # each placeholder, in order, once per merged patch of its image
                parts = t.split(IMAGE_TOKEN)
                texts[i] = parts[0] + "".join(IMAGE_TOKEN * int(next(counts)) + p for p in parts[1:])
        tokens = self.tokenizer(texts, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**tokens, **features})

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> list[str]:  # type: ignore[override]
        """The files ``Qwen2VLProcessor.from_pretrained`` reads: the image processor's configuration and the
        tokenizer."""
        self.image_processor.save_pretrained(str(save_directory))
        self.tokenizer.save_pretrained(str(save_directory))
        return [str(save_directory)]

    @classmethod
    def load(cls, path: str, tokenizer: Any) -> QwenVLInputs:
        """From a checkpoint's ``processor`` folder (a local directory or a hub id; its image processor) and the
        pipeline's tokenizer."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return cls(Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor"), tokenizer)
