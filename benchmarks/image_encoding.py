"""What sending an image to a VLM judge costs the trainer's CPU: PNG vs JPEG (quality 95), the encoding the
``vlm-judge`` reward does per image (``image_format``), side by side in one run.

    python benchmarks/image_encoding.py [--sizes 64,512,1024] [--reps 5]

Two kinds of image per size: uniform noise (the worst case for both codecs, what a random-weight preset draws)
and a smooth picture with a little noise. Per format: CPU time per image (process time, median of ``--reps``
rounds) and the encoded size. Writes ``benchmarks/results/image_encoding.json``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np
from _train import environment, write
from PIL import Image

FORMATS = {"png": {"format": "PNG"}, "jpeg": {"format": "JPEG", "quality": 95}}


def images(size: int) -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    smooth = np.stack([np.sin(6 * x + 1), np.cos(5 * y), np.sin(3 * (x + y))], -1) * 0.4 + 0.5
    smooth = np.clip(smooth + rng.normal(0, 0.03, smooth.shape), 0, 1)
    return {name: Image.fromarray((a * 255).round().astype(np.uint8))
            for name, a in (("noise", rng.random((size, size, 3))), ("smooth", smooth))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,512,1024")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    result = {"environment": environment(), "rows": []}
    for size in (int(s) for s in args.sizes.split(",")):
        for kind, image in images(size).items():
            row = {"size": size, "image": kind}
            inner = max(1, 4096 // size)  # enough encodes per round to time the small ones
            for name, kwargs in FORMATS.items():
                rounds = []
                for _ in range(args.reps):
                    start = time.process_time()
                    for _ in range(inner):
                        buffer = io.BytesIO()
                        image.save(buffer, **kwargs)
                    rounds.append((time.process_time() - start) / inner)
                row[name] = {"ms": 1000 * statistics.median(rounds), "bytes": buffer.tell()}
            row["png_over_jpeg_time"] = row["png"]["ms"] / row["jpeg"]["ms"]
            row["png_over_jpeg_size"] = row["png"]["bytes"] / row["jpeg"]["bytes"]
            result["rows"].append(row)
            print(f"{size:5d} px {kind:6s}  png {row['png']['ms']:8.2f} ms {row['png']['bytes']:9d} B | jpeg "
                  f"{row['jpeg']['ms']:7.2f} ms {row['jpeg']['bytes']:9d} B | png/jpeg time "
                  f"{row['png_over_jpeg_time']:.1f}x, size {row['png_over_jpeg_size']:.1f}x", flush=True)
    print(f"wrote {write('image_encoding', result)}")


if __name__ == "__main__":
    main()
