"""What caching the prompt's keys and values saves per velocity call (``BagelOptions.prompt_kv_cache``).

BAGEL has no separate text encoder: the prompt runs through the same MoT language model as the image. Text only
attends to earlier text, so its keys and values in every layer do not depend on the image block; with them cached
a denoising step runs the image block only. This script times one velocity call (forward, and forward + backward
as in training) with and without the cache, on BAGEL's layer structure at a reduced width (the saving is a
ratio of token counts, the same at full width), for a small and a 512 x 512 image, and writes JSON.

    python plugins/models/bagel/benchmarks/prompt_kv_cache.py [--out FILE] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from omnirl_plugin_bagel.config import BagelConfig, LLMConfig
from omnirl_plugin_bagel.transformer import BagelTransformer


def _time(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def measure(side_tokens: int, prompt_tokens: int, batch: int, reps: int) -> dict:
    torch.manual_seed(0)
    llm = LLMConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=1024, vocab_size=1000)
    net = BagelTransformer(BagelConfig(llm=llm, max_latent_size=max(side_tokens, 2))).eval()
    n = side_tokens * side_tokens
    ids = torch.randint(10, 1000, (batch, prompt_tokens))
    mask = torch.ones_like(ids)
    x, t = torch.randn(batch, n, 64), torch.full((batch,), 0.5)
    with torch.no_grad():
        kv = net.prompt_kv(ids, mask)
        encode_s = _time(lambda: net.prompt_kv(ids, mask), reps)
        plain_s = _time(lambda: net(x, t, side_tokens, side_tokens, ids, mask, 1, 2), reps)
        cached_s = _time(lambda: net(x, t, side_tokens, side_tokens, ids, mask, 1, 2, prompt_kv=kv), reps)
    x.requires_grad_(True)
    plain_bw = _time(lambda: net(x, t, side_tokens, side_tokens, ids, mask, 1, 2).sum().backward(), reps)
    cached_bw = _time(lambda: net(x, t, side_tokens, side_tokens, ids, mask, 1, 2, prompt_kv=kv).sum().backward(), reps)
    return {
        "image_px": side_tokens * 16, "latent_tokens": n, "prompt_tokens": prompt_tokens, "batch": batch,
        "forward_s": {"no_cache": plain_s, "cache": cached_s, "saved_frac": 1 - cached_s / plain_s},
        "forward_backward_s": {"no_cache": plain_bw, "cache": cached_bw, "saved_frac": 1 - cached_bw / plain_bw},
        "token_share_of_prompt": prompt_tokens / (prompt_tokens + n + 2),
        "encode_once_s": encode_s,
        "kv_bytes_per_prompt_token_full_size": 28 * 2 * 4 * 128 * 2,  # layers x (k, v) x kv heads x head dim x bf16
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file to write (default: stdout)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results = {"threads": torch.get_num_threads(),
               "cases": [measure(4, 24, 8, args.reps), measure(32, 24, 2, args.reps)]}
    text = json.dumps(results, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
