"""Pictures of a run: sample grids and the reward curve (PIL only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import torch


def to_pil(image: torch.Tensor | np.ndarray | Image.Image, min_side: int = 96) -> Image.Image:
    """(3, H, W) in [0, 1] -> PIL, upscaled (nearest) so tiny images stay visible; video (3, F, H, W) ->
    a strip of its frames."""
    import numpy as np

    arr = image.detach().float().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
    if arr.ndim == 4:  # video: frames side by side
        arr = np.concatenate(list(arr.transpose(1, 0, 2, 3)), axis=-1)
    pil = Image.fromarray((arr.transpose(1, 2, 0).clip(0, 1) * 255).round().astype("uint8"))
    scale = max(1, min_side // max(1, min(pil.size)))
    return pil.resize((pil.width * scale, pil.height * scale), Image.Resampling.NEAREST) if scale > 1 else pil


def image_grid(images: list[Any], prompts: list[str], columns: int,
               sources: list[tuple[str, ...]] | None = None) -> Image.Image:
    """One row per ``columns`` images under its first prompt. ``sources``: each image's condition images (an edit's
    source, paths); when any has one, every row opens with its first image's sources, so that a row reads source,
    instruction and results side by side."""
    tiles = [to_pil(im) for im in images]
    w, h = tiles[0].size
    label_h = 14
    rows = (len(tiles) + columns - 1) // columns
    lead = max((len(sources[r * columns]) for r in range(rows)), default=0) if sources else 0
    grid = Image.new("RGB", ((lead + columns) * w, rows * (h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for r in range(rows):
        for k, path in enumerate(sources[r * columns] if lead and sources else ()):
            grid.paste(source_tile(path, (w, h)), (k * w, r * (h + label_h) + label_h))
    for i, tile in enumerate(tiles):
        r, c = divmod(i, columns)
        grid.paste(tile, ((lead + c) * w, r * (h + label_h) + label_h))
        if c == 0:
            label = f"{prompts[i]}  (source | results)" if lead else prompts[i]
            draw.text((2, r * (h + label_h) + 1), label[: (lead + columns) * w // 6], fill="black", font=font)
    return grid


def source_tile(path: str, size: tuple[int, int]) -> Image.Image:
    """A condition image fitted into a tile of ``size`` (width, height), its aspect kept on a grey margin."""
    from omnirl_core.data.images import load_image

    image = load_image(path)
    scale = min(size[0] / image.width, size[1] / image.height)  # small sources (the tiny presets') enlarged sharp
    image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))),
                         Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS)
    tile = Image.new("RGB", size, (160, 160, 160))
    tile.paste(image, ((size[0] - image.width) // 2, (size[1] - image.height) // 2))
    return tile


def side_by_side(source: str, output: Any, caption: str, side: int = 256) -> Image.Image:
    """An edit as one picture: the source and the result, each fitted into ``side`` pixels, under the
    instruction."""
    result = to_pil(output, min_side=side)
    result.thumbnail((side, side), Image.Resampling.LANCZOS)
    label_h = 14
    canvas = Image.new("RGB", (2 * side, side + label_h), "white")
    canvas.paste(source_tile(source, (side, side)), (0, label_h))
    canvas.paste(result, (side + (side - result.width) // 2, label_h + (side - result.height) // 2))
    ImageDraw.Draw(canvas).text((2, 1), caption[: 2 * side // 6], fill="black", font=ImageFont.load_default())
    return canvas


def is_video(output: object) -> bool:
    """A decoded video is (3, F, H, W); an image is (3, H, W)."""
    return len(getattr(output, "shape", ())) == 4


def video_grid_gif(videos: list[torch.Tensor], prompts: list[str], columns: int, path: str | Path,
                   fps: float = 8.0) -> None:
    """An animated GIF of the sample grid: frame f shows every video's f-th frame in its cell (a shorter
    video holds its last frame)."""
    frames = max(v.shape[1] for v in videos)
    grids = [image_grid([v[:, min(f, v.shape[1] - 1)] for v in videos], prompts, columns) for f in range(frames)]
    grids[0].save(path, save_all=True, append_images=grids[1:], duration=round(1000 / fps), loop=0)


def reward_curve(records: list[dict[str, Any]], width: int = 640, height: int = 360) -> Image.Image:
    """Mean reward per step with a +-std band, plus a moving average."""
    steps = [r["step"] for r in records]
    means = [r["reward/mean"] for r in records]
    stds = [r.get("reward/std", 0.0) for r in records]
    lo = min(m - s for m, s in zip(means, stds))
    hi = max(m + s for m, s in zip(means, stds))
    if hi - lo < 1e-9:
        hi, lo = hi + 0.5, lo - 0.5
    ml, mr, mt, mb = 60, 20, 30, 40
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    s0, s1 = min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1

    def xy(step: float, value: float) -> tuple[float, float]:
        x = ml + (step - s0) / (s1 - s0) * (width - ml - mr)
        y = mt + (hi - value) / (hi - lo) * (height - mt - mb)
        return x, y

    band = [xy(s, m + sd) for s, m, sd in zip(steps, means, stds)]
    band += [xy(s, m - sd) for s, m, sd in reversed(list(zip(steps, means, stds)))]
    if len(band) >= 3:
        d.polygon(band, fill=(210, 225, 245))
    d.line([xy(s, m) for s, m in zip(steps, means)], fill=(40, 90, 200), width=1)
    k = max(1, len(means) // 10)
    smooth = [sum(means[max(0, i - k + 1): i + 1]) / len(means[max(0, i - k + 1): i + 1]) for i in range(len(means))]
    d.line([xy(s, m) for s, m in zip(steps, smooth)], fill=(200, 60, 40), width=2)
    d.rectangle([ml, mt, width - mr, height - mb], outline="black")
    for frac in (0.0, 0.5, 1.0):
        value = lo + frac * (hi - lo)
        _, y = xy(s0, value)
        d.text((4, y - 5), f"{value:.3f}", fill="black", font=font)
    d.text((ml, height - mb + 6), f"step {s0}", fill="black", font=font)
    d.text((width - mr - 60, height - mb + 6), f"step {s1}", fill="black", font=font)
    d.text((ml, 8), "reward/mean (blue, band = +-std), moving average (red)", fill="black", font=font)
    return img
