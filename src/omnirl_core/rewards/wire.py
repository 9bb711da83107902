"""The reward server's wire format: JSON, with images and video frames as base64 PNG (no pickle).

    POST /score   {"prompts": [str, ...], "outputs": [OUTPUT, ...], "inputs": [record | null, ...]}
                  -> 200 {"scores": [float, ...]}   or   4xx / 5xx {"error": str}
    GET  /health  -> {"reward": NAME, "modality": [...], "uses_inputs": bool, "requests": n, "batches": n, ...}

    OUTPUT = {"kind": "image", "png": B64}                  (3, H, W) in [0, 1]
           | {"kind": "video", "frames": [B64, ...]}        (3, F, H, W) in [0, 1], one PNG per frame
           | {"kind": "text", "text": str}

Images go over 8-bit, rounded like a saved picture (``round(clamp(x, 0, 1) * 255)``), the rounding every
image reward here applies first, so a served image reward scores exactly what it scores in process. Video goes
as lossless PNG frames rather than MP4: an MP4 needs an encoder (PyAV / ffmpeg) and its lossy compression would
change the scores.
"""

from __future__ import annotations

import base64
import io
from typing import Any

MAX_SIDE = 8192


class WireError(ValueError):
    """A request or answer that does not follow the wire format."""


def _png(frame_u8: Any) -> str:
    """(3, H, W) uint8 array -> base64 PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame_u8.transpose(1, 2, 0), mode="RGB").save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _unpng(data: str, where: str) -> Any:
    """base64 PNG -> (3, H, W) float32 tensor in [0, 1]."""
    import numpy as np
    import torch
    from PIL import Image

    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            if image.format != "PNG":
                raise WireError(f"{where}: not a PNG ({image.format})")
            if max(image.size) > MAX_SIDE:
                raise WireError(f"{where}: {image.size[0]}x{image.size[1]} is larger than {MAX_SIDE} px")
            array = np.array(image.convert("RGB"), dtype=np.uint8)
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's bad input
        raise WireError(f"{where}: not a readable base64 PNG ({type(exc).__name__}: {exc})") from None
    return torch.from_numpy(array).permute(2, 0, 1).contiguous().float() / 255  # (3, H, W) like a model output


def encode_output(output: Any) -> dict[str, Any]:
    """One model output (a (3, H, W) image, a (3, F, H, W) video, or a string) as a wire OUTPUT."""
    if isinstance(output, str):
        return {"kind": "text", "text": output}
    import torch

    x = output.detach() if isinstance(output, torch.Tensor) else torch.as_tensor(output)
    u8 = (x.float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)  # the rounding of a saved 8-bit picture
    if x.dim() == 3 and x.shape[0] == 3:
        return {"kind": "image", "png": _png(u8.numpy())}
    if x.dim() == 4 and x.shape[0] == 3:
        return {"kind": "video", "frames": [_png(u8[:, f].numpy()) for f in range(u8.shape[1])]}
    raise WireError(f"cannot send an output of shape {tuple(x.shape)}: expected an image (3, H, W), a video "
                    "(3, F, H, W) or a string")


def decode_output(item: Any, where: str) -> Any:
    """A wire OUTPUT -> a (3, H, W) / (3, F, H, W) float tensor in [0, 1], or a string."""
    if not isinstance(item, dict):
        raise WireError(f"{where}: expected an object with 'kind', got {type(item).__name__}")
    kind = item.get("kind")
    if kind == "image" and isinstance(item.get("png"), str):
        return _unpng(item["png"], where)
    if kind == "video" and isinstance(item.get("frames"), list) and item["frames"]:
        import torch

        frames = [_unpng(f, f"{where}.frames[{i}]") if isinstance(f, str) else None
                  for i, f in enumerate(item["frames"])]
        if any(f is None for f in frames) or len({tuple(f.shape) for f in frames}) != 1:
            raise WireError(f"{where}: video frames must be base64 PNGs of one size")
        return torch.stack(frames, dim=1)
    if kind == "text" and isinstance(item.get("text"), str):
        return item["text"]
    raise WireError(f"{where}: expected {{'kind': 'image', 'png': B64}}, {{'kind': 'video', 'frames': [B64, ...]}} "
                    f"or {{'kind': 'text', 'text': STR}}; got kind {kind!r} with keys {sorted(item)}")


def decode_request(body: Any) -> tuple[list[Any], list[str], list[Any] | None]:
    """A /score body -> (outputs, prompts, inputs or None)."""
    if not isinstance(body, dict):
        raise WireError("the body must be a JSON object with 'prompts' and 'outputs'")
    prompts, outputs, inputs = body.get("prompts"), body.get("outputs"), body.get("inputs")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError("'prompts' must be a list of strings")
    if not isinstance(outputs, list) or len(outputs) != len(prompts):
        raise WireError(f"'outputs' must be a list as long as 'prompts' ({len(prompts)})")
    if inputs is not None and (not isinstance(inputs, list) or len(inputs) != len(prompts)):
        raise WireError(f"'inputs' must be a list as long as 'prompts' ({len(prompts)}), or absent")
    return [decode_output(o, f"outputs[{i}]") for i, o in enumerate(outputs)], prompts, inputs
