"""SGLang's prefix sharing: prefill tokens computed per rollout call with and without shared group prefixes.

    omnirl env build sglang                                   # once: the engine's environment (3-6 min)
    python benchmarks/sglang_prefix_sharing.py                # 3 group shapes, 5 calls per setting: about 6 min
    python benchmarks/sglang_prefix_sharing.py --calls 3 --shapes 4x4:short 2x8:200

The SGLang rollout engine (``omnirl_plugin_sglang``) starts once on the tiny Qwen3-Omni thinker (random weights,
64-wide text heads as in the plugin's tests, fp32, a LoRA of rank 4 that is never trained). For each
group shape, ``share_prefixes`` alternates false / true (the order swapped every round), ``--calls`` rounds after
one warm-up pair; every call follows a flush of SGLang's radix cache. A group shape is ``PxG:LEN``: P prompts x G
samples each, one request per sample, of the test's short prompts (``short``) or of prompts of at least LEN tokens
(numbered sentences, chat template included). Each call completes up to 12 tokens at temperature 1.

Per call, from the server's ``last_stats``: prompt tokens (the requests' prompts, summed), prefill tokens computed
(prompt tokens not taken from the radix cache, the prefilled shared prompts included) and the server's seconds;
and the call's wall time as the trainer sees it (``generate``, the round trip included). Per setting: the token
counts (the same every call) and the wall time's median and range. Writes
``benchmarks/results/sglang_prefix_sharing.json`` and prints the machine (CPU model, AVX-512 / AMX flags, load).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _train import describe, environment, write  # first: the thread policy, set before torch loads

SHORT = ["Hi there", "What is two plus two? Answer with a letter.", "Name a colour", "x"]
SHAPES = ["4x4:short", "2x8:200", "2x8:800"]


def parse_shape(text: str) -> tuple[int, int, str]:
    try:
        groups, rest = text.split("x", 1)
        size, length = rest.split(":", 1)
        if length != "short":
            int(length)
        return int(groups), int(size), length
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not PxG:LEN (e.g. 4x4:short or 2x8:200)") from None


def long_prompt(model: Any, index: int, tokens: int) -> str:
    """A prompt of at least ``tokens`` tokens (chat template included): numbered sentences, distinct per index."""
    from omnirl_core.ar.policy_gradient import AR_PLAN
    from omnirl_core.contracts import GenRequest

    sentences: list[str] = []
    while True:
        n = len(sentences)
        sentences.append(f"Note {index}.{n}: item {n} of list {index} weighs {(7 * n + 3 * index) % 97} grams.")
        text = " ".join(sentences) + " Which item is heaviest? Answer with a letter."
        request = GenRequest(uid=0, prompt=text, prompt_index=0, group=0, seed=0, height=0, width=0, plan=AR_PLAN)
        if len(model.encode_prompt(request).input_ids) >= tokens:
            return text


def group_requests(model: Any, groups: int, size: int, length: str) -> list[Any]:
    from omnirl_core.ar.policy_gradient import AR_PLAN
    from omnirl_core.contracts import GenRequest

    prompts = [SHORT[g % len(SHORT)] if length == "short" else long_prompt(model, g, int(length))
               for g in range(groups)]
    return [GenRequest(uid=i, prompt=prompts[i // size], prompt_index=i // size, group=i // size, seed=i, height=0,
                       width=0, plan=AR_PLAN) for i in range(groups * size)]


def call(engine: Any, requests: list[Any]) -> dict[str, Any]:
    engine.server.call("flush_cache")
    t0 = time.perf_counter()
    samples = list(engine.generate(requests))
    wall = time.perf_counter() - t0
    if len(samples) != len(requests):
        raise SystemExit(f"the engine returned {len(samples)} samples for {len(requests)} requests")
    s = engine.last_stats
    return {"wall_s": wall, "server_s": s["seconds"], "prompt_tokens": s["prompt_tokens"],
            "prefill_tokens": s["prefill_tokens"], "shared_prompts": s["shared_prompts"], "tokens": s["tokens"]}


def summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [c["wall_s"] for c in calls]
    return {"prompt_tokens": sorted({c["prompt_tokens"] for c in calls}),
            "prefill_tokens": sorted({c["prefill_tokens"] for c in calls}),
            "shared_prompts": calls[0]["shared_prompts"], "wall_s_median": statistics.median(walls),
            "wall_s_min": min(walls), "wall_s_max": max(walls),
            "server_s_median": statistics.median(c["server_s"] for c in calls), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="group shapes PxG:LEN (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per setting and shape, after one warm-up")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    shapes = [parse_shape(s) for s in args.shapes]

    import torch

    from omnirl_core.config import LoraConfig, ModelSection
    from omnirl_core.errors import UsageError
    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.serving.envs import component_environment, is_built

    try:
        built = is_built(component_environment("sglang", args.device))
    except UsageError as exc:
        raise SystemExit(f"the sglang engine plugin is not installed: {exc.message}") from None
    if not built:
        raise SystemExit(f"the sglang environment is not built: omnirl env build sglang --device {args.device}")
    from omnirl_plugin_sglang.engine import SglangRolloutEngine, SglangRolloutOptions

    result: dict[str, Any] = {"environment": environment(), "device": args.device, "calls_per_setting": args.calls,
                              "model": "qwen3-omni tiny (random weights), tiny_head_dim 64, fp32",
                              "max_new_tokens": 12, "shapes": {}}
    print("machine:", describe(result["environment"]), flush=True)
    spec = get_plugin_manager().resolve("model", "qwen3-omni")
    model = spec.load_factory()(ModelSection(name="qwen3-omni", preset="tiny"), spec.load_config()(tiny_head_dim=64),
                                args.device)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    longest = max((int(length) for _, _, length in shapes if length != "short"), default=0)
    size = max(p * g for p, g, _ in shapes)
    options = {"max_new_tokens": 12, "temperature": 1.0, "context_length": max(512, 2 * longest),
               "max_total_tokens": max(16384, 2 * size * (longest + 64))}

    def engine(share: bool) -> Any:  # both settings share one SGLang server (same engine arguments)
        return SglangRolloutEngine(model, SglangRolloutOptions(share_prefixes=share, **options),
                                   torch.device(args.device))

    t0 = time.perf_counter()
    engines = {False: engine(False), True: engine(True)}
    engines[False].server  # noqa: B018 - starts SGLang
    result["start_s"] = time.perf_counter() - t0
    print(f"SGLang started in {result['start_s']:.0f} s", flush=True)
    for (groups, size_, length), name in zip(shapes, args.shapes):
        requests = group_requests(model, groups, size_, length)
        prompt_len = [len(model.encode_prompt(requests[g * size_]).input_ids) for g in range(groups)]
        for share in (False, True):  # warm-up, not recorded
            call(engines[share], requests)
        calls: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for r in range(args.calls):
            for share in ((False, True) if r % 2 == 0 else (True, False)):
                calls[share].append(call(engines[share], requests))
        shape = {"prompts": groups, "samples_per_prompt": size_, "prompt_tokens_each": prompt_len,
                 "off": summary(calls[False]), "on": summary(calls[True])}
        result["shapes"][name] = shape
        for key, label in (("off", "share_prefixes false"), ("on", "share_prefixes true ")):
            s = shape[key]
            print(f"{name} ({groups} prompts of {'/'.join(map(str, prompt_len))} tokens x {size_}) {label}: "
                  f"{s['prompt_tokens']} prompt tokens, {s['prefill_tokens']} computed, wall "
                  f"{s['wall_s_median']:.2f} s median ({s['wall_s_min']:.2f}-{s['wall_s_max']:.2f}), "
                  f"server {s['server_s_median']:.2f} s", flush=True)
    result["environment"]["load_avg_1m_at_end"] = environment()["load_avg_1m"]
    path = write("sglang_prefix_sharing", result)
    print(f"on {describe(result['environment'])} (at the end {result['environment']['load_avg_1m_at_end']:.2f}); "
          f"wrote {path}")


if __name__ == "__main__":
    main()
