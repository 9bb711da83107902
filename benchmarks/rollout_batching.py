"""Rollout batching benchmark: step-wise continuous batching vs request-level (static) batching vs one
request at a time, on a uniform RL workload and a mixed one, plus the prompt-embedding cache's effect on
training steps.

    python benchmarks/rollout_batching.py            # full run, about 11 minutes on 2 cores
    python benchmarks/rollout_batching.py --quick    # a smaller run to check it works

Writes ``benchmarks/results/rollout_batching.json`` and prints a summary. Model: the Qwen-Image
architecture with random weights; ``--config small`` (default) widens the tiny preset's transformer to
8 layers x 128 hidden and narrows its VAE so that the denoiser call dominates, ``--config tiny`` is the
preset as is. Metrics per (workload, mode), from the engine's own counters:
throughput (samples / wall time from the first arrival to the last sample), mean and p95 latency (finish -
arrival), slot utilisation (useful sample-steps / (model calls x max_num_seqs)), padding share (compute
spent on rows that a static batch carries after they finished), and a time breakdown (velocity, sampler,
decode, admission incl. text encoding, idle waiting for arrivals, other).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omnirl_core.config import ModelSection
from omnirl_core.contracts import GenRequest, RolloutPlan

MODES = ("step", "request", "single")
DECODE_BATCH: int | str = "auto"
"""The step-wise engine's ``decode_batch`` (``--decode-batch``; the static modes decode each batch as a whole)."""
PROMPTS = [f"a {c} {s}" for c in ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")
           for s in ("square", "circle on a grey field", "apple", "sky over a calm sea")]
RESULTS = Path(__file__).resolve().parent / "results"


# -- model ----------------------------------------------------------------------------------------

def build_model(config: str) -> Any:
    """The Qwen-Image model behind the omnirl contract, random weights, CPU, fp32."""
    from omnirl_plugin_qwen_image.model import QwenImageOptions, create_model

    if config == "tiny":
        return create_model(ModelSection(name="qwen-image", preset="tiny"), None, "cpu")
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from omnirl_plugin_qwen_image.model import QwenImageModel
    from omnirl_plugin_qwen_image.tiny import build_tiny_pipeline

    tiny = build_tiny_pipeline(seed=0)
    torch.manual_seed(10)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=8, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=tiny.text_encoder.config.text_config.hidden_size, guidance_embeds=False,
        axes_dims_rope=(16, 8, 8),
    ).eval()
    torch.manual_seed(11)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).eval()
    pipeline = QwenImagePipeline(transformer=transformer, vae=vae, text_encoder=tiny.text_encoder,
                                 tokenizer=tiny.tokenizer, scheduler=tiny.scheduler)
    pipeline.set_progress_bar_config(disable=True)
    return QwenImageModel(pipeline, QwenImageOptions(), torch.device("cpu"), torch.float32)


# -- workloads ------------------------------------------------------------------------------------

def flowgrpo_plan(steps: int, sampler: str = "sde", window: int | None = None) -> RolloutPlan:
    """All steps but the last stochastic and trained, or a window of them from the start (fast variant)."""
    trained = tuple(range(steps - 1)) if window is None else tuple(range(window))
    kinds = tuple(sampler if i in trained else "ode" for i in range(steps))
    return RolloutPlan(step_kinds=kinds, train_steps=trained, eta=0.8 if sampler == "cps" else 0.7)


def uniform_workload(n: int, size: int, steps: int, group: int = 8) -> list[GenRequest]:
    """An RL rollout batch: n // group prompts x group samples, one shape and plan, all at once."""
    plan = flowgrpo_plan(steps)
    return [GenRequest(uid=i, prompt=PROMPTS[(i // group) % len(PROMPTS)], prompt_index=i // group,
                       group=i // group, seed=10_000 + i, height=size, width=size, plan=plan)
            for i in range(n)]


def mixed_workload(n: int, sizes: tuple[int, ...], steps: tuple[int, ...], seed: int = 0) -> list[GenRequest]:
    """Requests of several resolutions, step counts, CFG on/off, samplers and trained windows."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        num_steps = rng.choice(steps)
        plan = flowgrpo_plan(num_steps, sampler=rng.choice(("sde", "sde", "cps")),
                             window=rng.choice((None, None, 2)))
        size = rng.choice(sizes)
        out.append(GenRequest(uid=i, prompt=rng.choice(PROMPTS), prompt_index=i, group=i, seed=20_000 + i,
                              height=size, width=size, plan=plan, guidance_scale=rng.choice((1.0, 4.0))))
    return out


def with_arrivals(requests: list[GenRequest], window_s: float) -> list[GenRequest]:
    """The same requests arriving uniformly at random over ``window_s`` seconds."""
    rng = random.Random(1)
    return [dataclasses.replace(r, arrival_s=rng.uniform(0.0, window_s)) for r in requests]


# -- measuring ------------------------------------------------------------------------------------

def run_mode(model: Any, requests: list[GenRequest], mode: str, max_num_seqs: int,
             profile: bool = False) -> dict[str, Any]:
    from omnirl_plugin_diffusers.engine import DiffusersRolloutEngine, DiffusersRolloutOptions

    options = DiffusersRolloutOptions(mode=mode, max_num_seqs=max_num_seqs,
                                      decode_batch=DECODE_BATCH if mode == "step" else 1)
    engine = DiffusersRolloutEngine(model, options, "cpu")
    engine.embeddings.lookup(sorted({r.prompt for r in requests}) + [" "])  # warm cache: rollout time only
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    n = sum(1 for _ in engine.generate(requests))
    if profiler is not None:
        profiler.disable()
    assert n == len(requests), f"{mode}: {n} samples for {len(requests)} requests"
    out = engine.stats.summary()
    out["mode"] = mode
    if profiler is not None:
        out["profile_top"] = top_functions(profiler)
    return out


def top_functions(profiler: Any, limit: int = 20) -> list[dict[str, Any]]:
    """The functions with the most time spent in themselves (not in what they call)."""
    import pstats

    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls, "self_s": own,
                     "cumulative_s": cumulative})
    rows.sort(key=lambda r: r["self_s"], reverse=True)
    return rows[:limit]


def compare_modes(model: Any, requests: list[GenRequest], max_num_seqs: int, repeats: int,
                  single_repeats: int = 1) -> dict[str, Any]:
    """``step`` and ``request`` ``repeats`` times each, back to back in alternating order (the machine's
    noise and any position effect hit both alike), ``single`` (the slow baseline) ``single_repeats`` times.
    Per mode: the run with the median throughput, with every run's throughput; and the step / request
    throughput ratio of each back-to-back pair."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(repeats):
        order = ("step", "request") if rep % 2 == 0 else ("request", "step")
        if rep < single_repeats:
            order += ("single",)
        for mode in order:
            result = run_mode(model, requests, mode, max_num_seqs)
            runs[mode].append(result)
            print(f"    {mode:8s} rep {rep}: {result['throughput']:.2f} samples/s, util "
                  f"{result['slot_utilisation']:.2f}, wall {result['wall_s']:.1f}s", file=sys.stderr)
    out: dict[str, Any] = {}
    for mode, results in runs.items():
        ranked = sorted(results, key=lambda r: r["throughput"])
        out[mode] = {**ranked[len(ranked) // 2], "throughput_all": [r["throughput"] for r in results]}
    out["step_vs_request_pairs"] = [a["throughput"] / b["throughput"] for a, b in zip(runs["step"], runs["request"])]
    return out


# -- the cache's effect on training steps ---------------------------------------------------------

@contextlib.contextmanager
def text_encoder_probe() -> Iterator[dict[str, float]]:
    """Counts forward calls of Qwen-Image's text encoder (the prompts they encode, their seconds) with
    torch's global module hooks, whatever engine or executor makes them."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    counts = {"calls": 0, "prompts": 0, "seconds": 0.0}
    starts: list[float] = []

    def before(module, args):
        if isinstance(module, Qwen2_5_VLForConditionalGeneration):
            starts.append(time.perf_counter())

    def after(module, args, output):
        if isinstance(module, Qwen2_5_VLForConditionalGeneration):
            counts["calls"] += 1
            counts["prompts"] += output.hidden_states[-1].shape[0]
            counts["seconds"] += time.perf_counter() - starts.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def training_steps(steps: int, cache_size: int) -> list[dict[str, float]]:
    """``steps`` FlowGRPO steps of the tiny Qwen-Image preset through the real controller."""
    from omnirl_core.loop.controller import Controller
    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.resolve import resolve_run
    from omnirl_core.rundir.rundir import RunDir

    layers = [{"model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
               "run": {"steps": steps, "device": "cpu", "save_every": 10_000, "sample_every": 10_000},
               "rollout": {"options": {"embedding_cache_size": cache_size}}}]
    manager = get_plugin_manager()
    resolved = resolve_run(manager, layers)
    records: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, text_encoder_probe() as probe:
        run_dir = Path(tmp) / "run"
        RunDir(run_dir).prepare(resolved.dump(), resolved.lock(manager))
        seen = dict(probe)

        def on_step(record: dict[str, Any]) -> None:
            records.append({
                "step": record["step"],
                "text_encoder_calls": probe["calls"] - seen["calls"],
                "text_encoder_prompts": probe["prompts"] - seen["prompts"],
                "text_encoder_s": probe["seconds"] - seen["seconds"],
                "rollout_s": record["time/rollout_s"],
                "step_s": record["time/step_s"],
            })
            seen.update(probe)

        Controller(resolved, run_dir, on_step=on_step).run()
    return records


def cache_effect(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, size in (("with_cache", 1024), ("without_cache", 0)):
        records = training_steps(steps, size)
        later = records[1:] or records  # step 1 fills the cache; later steps show the steady state
        out[label] = {
            "embedding_cache_size": size,
            "per_step": records,
            "text_encoder_calls_per_step_after_first": statistics.fmean(r["text_encoder_calls"] for r in later),
            "text_encoder_prompts_per_step_after_first": statistics.fmean(r["text_encoder_prompts"] for r in later),
            "text_encoder_s_per_step_after_first": statistics.fmean(r["text_encoder_s"] for r in later),
            "step_s_median_after_first": statistics.median(r["step_s"] for r in later),
            "rollout_s_median_after_first": statistics.median(r["rollout_s"] for r in later),
        }
        print(f"    {label}: {out[label]['text_encoder_calls_per_step_after_first']:.1f} text-encoder calls/step, "
              f"{out[label]['step_s_median_after_first']:.3f} s/step", file=sys.stderr)
    return out


# -- main -----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("small", "tiny"), default="small")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared CPUs: 1).")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--decode-batch", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="the step-wise engine's rollout.options.decode_batch: finished requests decoded "
                        "together once this many have finished (1: each sample streamed out right after its last "
                        "step; auto, the default: 8 while requests queue, else 1)")
    parser.add_argument("--uniform-repeats", type=int, default=5, help="step/request pairs on uniform.")
    parser.add_argument("--mixed-repeats", type=int, default=3, help="step/request pairs on mixed.")
    parser.add_argument("--uniform-requests", type=int, default=96)
    parser.add_argument("--mixed-requests", type=int, default=512)
    parser.add_argument("--arrival-fraction", type=float, default=0.3,
                        help="Mixed arrivals spread over this fraction of the step-wise burst time.")
    parser.add_argument("--train-steps", type=int, default=4, help="Training steps per cache setting.")
    parser.add_argument("--profile", action="store_true",
                        help="One more step-wise run of the mixed workload under cProfile (top functions).")
    parser.add_argument("--quick", action="store_true", help="Small workloads, one repeat.")
    parser.add_argument("--out", type=Path, default=RESULTS / "rollout_batching.json")
    args = parser.parse_args()
    global DECODE_BATCH
    DECODE_BATCH = args.decode_batch
    if args.quick:
        args.uniform_requests, args.mixed_requests, args.train_steps = 32, 48, 2
        args.uniform_repeats = args.mixed_repeats = 1

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = build_model(args.config)
    denoiser_params = sum(p.numel() for p in model.denoiser.parameters())
    print(f"model: {args.config}, denoiser {denoiser_params / 1e6:.2f} M parameters, {args.threads} thread(s)",
          file=sys.stderr)

    uniform = uniform_workload(args.uniform_requests, size=48, steps=8)
    print("uniform workload", file=sys.stderr)
    run_mode(model, uniform[: args.max_num_seqs], "step", args.max_num_seqs)  # warm-up
    uniform_results = compare_modes(model, uniform, args.max_num_seqs, args.uniform_repeats)

    sizes, steps = (32, 48, 64), (4, 8, 12)
    burst = mixed_workload(args.mixed_requests, sizes, steps)
    print("mixed workload: calibrating the arrival window (step-wise, all at once)", file=sys.stderr)
    calibration = run_mode(model, burst, "step", args.max_num_seqs)
    window = args.arrival_fraction * calibration["wall_s"]
    mixed = with_arrivals(burst, window)
    print(f"mixed workload: arrivals over {window:.2f}s", file=sys.stderr)
    mixed_results = compare_modes(model, mixed, args.max_num_seqs, args.mixed_repeats)
    profile = None
    if args.profile:
        print("mixed workload: step-wise under cProfile", file=sys.stderr)
        profile = run_mode(model, mixed, "step", args.max_num_seqs, profile=True)["profile_top"]

    print("prompt-embedding cache on training steps (tiny preset)", file=sys.stderr)
    torch.set_num_threads(args.threads)
    cache = cache_effect(args.train_steps)

    def ratio(results: dict[str, Any]) -> float:
        """Median step / request throughput over the back-to-back pairs."""
        return statistics.median(results["step_vs_request_pairs"])

    targets = {
        "mixed_step_vs_request_throughput": {"value": ratio(mixed_results), "target": 1.3},
        "uniform_step_vs_request_throughput": {"value": ratio(uniform_results), "target": 0.97},
        "mixed_step_slot_utilisation": {"value": mixed_results["step"]["slot_utilisation"], "target": 0.9},
    }
    for t in targets.values():
        t["met"] = t["value"] >= t["target"]
    report = {
        "benchmark": "rollout_batching",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": args.threads},
        "config": {"model": args.config, "denoiser_parameters": denoiser_params, "max_num_seqs": args.max_num_seqs,
                   "decode_batch": args.decode_batch,
                   "repeats": {"uniform": args.uniform_repeats, "mixed": args.mixed_repeats}},
        "workloads": {
            "uniform": {"requests": len(uniform), "size": 48, "steps": 8, "guidance_scale": 1.0,
                        "arrivals": "all at 0", "results": uniform_results},
            "mixed": {"requests": len(mixed), "sizes": sizes, "steps": steps, "guidance_scales": [1.0, 4.0],
                      "samplers": ["sde", "cps"], "arrival_window_s": window,
                      "calibration_step_burst": calibration, "results": mixed_results,
                      "profile_step_cprofile_top": profile},
        },
        "targets": targets,
        "embedding_cache": cache,
        "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_summary(report)
    print(f"\nwrote {args.out}")


def print_summary(report: dict[str, Any]) -> None:
    columns = ("throughput", "latency_mean_s", "latency_p95_s", "slot_utilisation", "padding_share",
               "mean_batch_rows", "model_calls", "decode_calls", "time_velocity_s", "time_decode_s",
               "time_idle_s", "wall_s")
    for name, workload in report["workloads"].items():
        print(f"\n{name} ({workload['requests']} requests)")
        print(f"{'mode':8s} " + " ".join(f"{c:>16s}" for c in columns))
        for mode in MODES:
            r = workload["results"][mode]
            print(f"{mode:8s} " + " ".join(f"{r[c]:16.3f}" for c in columns))
        pairs = workload["results"]["step_vs_request_pairs"]
        print("step / request throughput, back-to-back pairs: " + ", ".join(f"{p:.3f}" for p in pairs))
    print("\ntargets")
    for name, t in report["targets"].items():
        print(f"  {name}: {t['value']:.3f} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    print("\nembedding cache (tiny preset training steps, after the first)")
    for label, c in report["embedding_cache"].items():
        first = c["per_step"][0]
        print(f"  {label}: step 1: {first['text_encoder_calls']} calls / {first['text_encoder_prompts']} prompts; "
              f"later: {c['text_encoder_calls_per_step_after_first']:.1f} calls / "
              f"{c['text_encoder_prompts_per_step_after_first']:.1f} prompts per step, "
              f"{c['text_encoder_s_per_step_after_first'] * 1000:.1f} ms text encoder/step, "
              f"{c['step_s_median_after_first']:.3f} s/step")


if __name__ == "__main__":
    main()
