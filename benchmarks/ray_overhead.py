"""Overhead of the Ray executor vs inline on the same tiny run.

    /work/venv/bin/python benchmarks/ray_overhead.py [--steps 4]

Tiny Qwen-Image + FlowGRPO + colour reward; the same seeds. Inline first, then Ray (local instance,
colocated actor+rollout worker with 2 CPUs, 2 reward actors). Both use 2 torch threads. Reports the mean
step time over the steps after the first, the setup time, and the ratios Ray / inline.
Writes ``benchmarks/results/ray_overhead.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _train import controller, environment, mean, write


def timed_run(out: Path, steps: int, run: dict) -> dict:
    ctl = controller(out, {"rewards": [{"name": "color"}], "run": {"steps": steps, **run}})
    t0 = time.perf_counter()
    ctl.setup()
    setup_s = time.perf_counter() - t0
    records = [ctl.train_step(step) for step in range(1, steps + 1)]
    ctl.executor.close()
    return {"setup_s": setup_s, "first_step_s": records[0]["time/step_s"],
            "step_s": mean(records[1:], "time/step_s"), "reward_mean_last": records[-1]["reward/mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="omnirl-bench-"))
    torch.set_num_threads(2)
    inline = timed_run(tmp / "inline", args.steps, {})
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = timed_run(tmp / "ray", args.steps, {"executor": "ray", "worker_cpus": 2.0})
    finally:
        ray.shutdown()
    result = {"environment": environment(), "steps": args.steps, "inline": inline, "ray": on_ray,
              "step_time_ratio": on_ray["step_s"] / inline["step_s"],
              "setup_time_ratio": on_ray["setup_s"] / inline["setup_s"],
              "same_last_reward": abs(on_ray["reward_mean_last"] - inline["reward_mean_last"]) < 1e-5}
    path = write("ray_overhead", result)
    print(f"step: inline {inline['step_s']:.2f}s ray {on_ray['step_s']:.2f}s ratio {result['step_time_ratio']:.2f}; "
          f"setup: inline {inline['setup_s']:.1f}s ray {on_ray['setup_s']:.1f}s; wrote {path}")


if __name__ == "__main__":
    main()
