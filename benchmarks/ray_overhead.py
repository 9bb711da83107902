"""Overhead of the Ray executor vs inline on the same tiny run.

    python benchmarks/ray_overhead.py [--steps 4]

Tiny Qwen-Image + FlowGRPO + colour reward; the same seeds. Inline first, then Ray (local instance,
colocated actor+rollout worker with 2 CPUs, 2 reward actors). Both use 2 torch threads. Two workloads: the
preset's (32 px, 6 steps: a step of a fraction of a second, where Ray's fixed per-step cost shows most) and
a larger one (64 px, 10 steps, 16 prompts x 4). Reports per workload the mean step time over the steps after
the first (and its rollout / train parts), the setup time, the ratios Ray / inline and the absolute
overhead per step.
Writes ``benchmarks/results/ray_overhead.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _train import controller, environment, mean, write

WORKLOADS = {
    "preset": {},
    "larger": {"rollout": {"prompts_per_step": 16, "group_size": 4, "num_steps": 10, "height": 64, "width": 64}},
}


def timed_run(out: Path, steps: int, run: dict, workload: dict) -> dict:
    ctl = controller(out, {"rewards": [{"name": "color"}], "run": {"steps": steps, **run}, **workload})
    t0 = time.perf_counter()
    ctl.setup()
    setup_s = time.perf_counter() - t0
    records = [ctl.train_step(step) for step in range(1, steps + 1)]
    ctl.executor.close()
    return {"setup_s": setup_s, "first_step_s": records[0]["time/step_s"],
            "step_s": mean(records[1:], "time/step_s"), "rollout_s": mean(records[1:], "time/rollout_s"),
            "train_s": mean(records[1:], "time/train_s"), "reward_mean_last": records[-1]["reward/mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    import ray

    tmp = Path(tempfile.mkdtemp(prefix="omnirl-bench-"))
    torch.set_num_threads(2)
    result: dict = {"environment": environment(), "steps": args.steps}
    inline = {name: timed_run(tmp / f"inline-{name}", args.steps, {}, w) for name, w in WORKLOADS.items()}
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = {name: timed_run(tmp / f"ray-{name}", args.steps, {"executor": "ray", "worker_cpus": 2.0}, w)
                  for name, w in WORKLOADS.items()}
    finally:
        ray.shutdown()
    for name in WORKLOADS:
        a, b = inline[name], on_ray[name]
        result[name] = {"inline": a, "ray": b, "step_time_ratio": b["step_s"] / a["step_s"],
                        "overhead_per_step_s": b["step_s"] - a["step_s"],
                        "setup_time_ratio": b["setup_s"] / a["setup_s"],
                        "same_last_reward": abs(b["reward_mean_last"] - a["reward_mean_last"]) < 1e-5}
        print(f"{name}: step inline {a['step_s']:.2f}s ray {b['step_s']:.2f}s ratio "
              f"{result[name]['step_time_ratio']:.2f} (+{result[name]['overhead_per_step_s']:.3f}s/step); setup "
              f"inline {a['setup_s']:.1f}s ray {b['setup_s']:.1f}s")
    print(f"wrote {write('ray_overhead', result)}")

if __name__ == "__main__":
    main()
