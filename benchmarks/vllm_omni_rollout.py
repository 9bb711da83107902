"""Rollout throughput: the vllm-omni engine vs the embedded diffusers engine on the same tiny workload.

    python benchmarks/vllm_omni_rollout.py [--requests 16 --steps 6 --repeats 3]

Run it alone on a quiet machine: the report records the load average before and after (``os.getloadavg``).

Needs the engine environment (``omnirl env build vllm-omni``). Workload: the Qwen-Image tiny preset, 32x32,
a FlowGRPO-style plan (SDE steps then a last ODE step), one batch of requests with distinct seeds. Each engine
generates the batch ``repeats`` times after one warm-up batch (vllm-omni's first requests pay its start);
throughput = samples / median wall time. Writes ``benchmarks/results/vllm_omni_rollout.json``.

Caveat: on a CPU, with a random-weight model a few kilobytes in size, both engines spend their time in
Python overhead (vllm-omni: its scheduler, its per-step state gathering and a process boundary; diffusers:
our own loop), not in kernels. The ratio says nothing about GPU speed, where vllm-omni's kernels, CUDA graphs
and parallelism are what matter; ``plugins/engines/vllm-omni/gpu_check.py`` measures that.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def workload(n: int, steps: int):
    from omnirl_core.contracts import GenRequest, RolloutPlan

    plan = RolloutPlan(step_kinds=("sde",) * (steps - 1) + ("ode",), train_steps=tuple(range(steps - 1)), eta=0.7)
    prompts = ["a red square", "a blue circle on a green field", "cat", "a yellow star"]
    return [GenRequest(uid=i, prompt=prompts[i % 4], prompt_index=i % 4, group=i % 4, seed=100 + i, height=32,
                       width=32, plan=plan) for i in range(n)]


def timed(engine, requests, repeats: int) -> list[float]:
    list(engine.generate(requests))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        samples = list(engine.generate(requests))
        times.append(time.perf_counter() - start)
        assert len(samples) == len(requests)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm_omni_rollout.json")
    args = parser.parse_args()

    from omnirl_core.config import LoraConfig, ModelSection
    from omnirl_core.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    load_before = os.getloadavg()
    create_model = plugins.resolve("model", "qwen-image").load_factory()
    vllm_spec, diff_spec = plugins.resolve("engine", "vllm-omni"), plugins.resolve("engine", "diffusers")
    VllmOmniRolloutEngine, VllmOmniRolloutOptions = vllm_spec.load_factory(), vllm_spec.load_config()
    DiffusersRolloutEngine, DiffusersRolloutOptions = diff_spec.load_factory(), diff_spec.load_config()
    model = create_model(ModelSection(name="qwen-image", preset="tiny"), None, "cpu")
    model.setup_training(LoraConfig(rank=16, alpha=16), need_reference=False)
    requests = workload(args.requests, args.steps)
    started = time.perf_counter()
    vllm_engine = VllmOmniRolloutEngine(model, VllmOmniRolloutOptions(max_num_seqs=args.requests), "cpu")
    vllm_times = timed(vllm_engine, requests, args.repeats)
    start_s = time.perf_counter() - started - sum(vllm_times)
    diff_engine = DiffusersRolloutEngine(model, DiffusersRolloutOptions(max_num_seqs=args.requests), "cpu")
    diff_times = timed(diff_engine, requests, args.repeats)
    vllm_tp = args.requests / statistics.median(vllm_times)
    diff_tp = args.requests / statistics.median(diff_times)
    report = {
        "workload": {"requests": args.requests, "steps": args.steps, "size": 32, "model": "qwen-image tiny, fp32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "vllm_omni": {"seconds": vllm_times, "samples_per_s": vllm_tp,
                      "start_and_warmup_s": round(start_s, 1)},
        "diffusers": {"seconds": diff_times, "samples_per_s": diff_tp},
        "ratio_vllm_omni_over_diffusers": vllm_tp / diff_tp,
        "caveat": "CPU, random-weight tiny model: Python overhead dominates; says nothing about GPU speed.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"vllm-omni {vllm_tp:.2f} samples/s, diffusers {diff_tp:.2f} samples/s, "
          f"ratio {vllm_tp / diff_tp:.2f} (CPU; not a GPU figure) -> {args.out}")


if __name__ == "__main__":
    main()
