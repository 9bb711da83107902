"""Overhead of the Ray executor vs inline on the same tiny run.

    python benchmarks/ray_overhead.py [--rounds 3] [--steps 4] [--workloads larger]
    python benchmarks/ray_overhead.py --set run.threads=fixed         # a setting for both executors
    python benchmarks/ray_overhead.py --ray-set run.worker_cpus=1     # a setting for the Ray runs only
    python benchmarks/ray_overhead.py --ray-env GOMP_SPINCOUNT=1000   # an environment variable for them
    python benchmarks/ray_overhead.py --modes inline,ray,ray-whole     # also Ray with whole samples streamed
    python benchmarks/ray_overhead.py --modes inline,ray,ray-serve     # also Ray with the rewards on Ray Serve

Tiny Qwen-Image + FlowGRPO + colour reward; the same seeds. Every run is a process of its own, as a user's
would be (the inline runs never import Ray); Ray runs start a local instance with 3 logical CPUs: a colocated
actor+rollout worker with 2 CPUs and the reward actor (``run.reward_workers``, 1 by default). Rounds alternate
the order (inline first, then Ray first), so that the machine's drift hits both alike. Two workloads: the preset's (32 px, 6 steps: a step of
a fraction of a second, where Ray's fixed per-step cost shows most) and a larger one (64 px, 10 steps,
16 prompts x 4). Per run: the mean step time over the steps after the first, its rollout and train parts,
the setup time; per workload: the ratio Ray / inline of each round and their median. ``ray-whole`` is the Ray
run with the trajectories travelling (each sample streamed whole to the controller and sent back in the
update's units), as before the colocated worker kept them: the algorithm is told, in that run's driver only,
that its controller side reads trajectories (``Algorithm.controller_reads_trajectory``). ``ray-serve`` is the Ray
run with the rewards as a Ray Serve deployment (``run.reward_serving=serve``, one replica) instead of a reward actor.
Writes ``benchmarks/results/ray_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _train import controller, environment, mean, write  # first: the thread policy, before torch

from omnirl_core.config import deep_merge, parse_set

WORKLOADS = {
    "preset": {},
    "larger": {"rollout": {"prompts_per_step": 16, "group_size": 4, "num_steps": 10, "height": 64, "width": 64}},
}
RAY = {"executor": "ray", "worker_cpus": 2.0}
MODES = ("inline", "ray", "ray-whole", "ray-serve")
MODE_SETTINGS = {"ray-serve": {"run": {"reward_serving": "serve"}}}


def child(mode: str, workload: str, steps: int, sets: dict) -> dict:
    """One run in this process (``--child``): returns its figures."""
    import torch

    torch.set_num_threads(2)
    if mode == "ray-whole":  # the executor decides in the driver whether the worker keeps the trajectories
        from omnirl_core.flow.policy_gradient import FlowPolicyGradient

        FlowPolicyGradient.controller_reads_trajectory = True
    if mode.startswith("ray"):
        import ray

        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    overrides = deep_merge({"rewards": [{"name": "color"}], "run": {"steps": steps}, **WORKLOADS[workload]}, sets)
    try:
        ctl = controller(Path(tempfile.mkdtemp(prefix="omnirl-bench-")), overrides)
        t0 = time.perf_counter()
        ctl.setup()
        setup_s = time.perf_counter() - t0
        records = [ctl.train_step(step) for step in range(1, steps + 1)]
        ctl.executor.close()
    finally:
        if mode.startswith("ray"):
            import ray

            ray.shutdown()
    return {"setup_s": setup_s, "first_step_s": records[0]["time/step_s"],
            "step_s": mean(records[1:], "time/step_s"), "rollout_s": mean(records[1:], "time/rollout_s"),
            "train_s": mean(records[1:], "time/train_s"), "reward_mean_last": records[-1]["reward/mean"],
            "load_avg_1m": os.getloadavg()[0],
            # the pool each step ran on and the wait share that set it (run.threads: adaptive, the default)
            "threads": [r.get("threads/torch") for r in records],
            "wait_shares": [round(r["threads/wait_share"], 3) if "threads/wait_share" in r else None for r in records]}


def spawn(mode: str, workload: str, steps: int, sets: dict, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--workload", workload, "--steps", str(steps),
                           "--sets-json", json.dumps(sets)], capture_output=True, text=True, check=False,
                          env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {workload} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (inline, Ray) runs, alternating the order")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the means")
    parser.add_argument("--workloads", default="preset,larger", help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for both executors (repeatable)")
    parser.add_argument("--ray-set", dest="ray_sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for the Ray runs only (repeatable)")
    parser.add_argument("--ray-env", dest="ray_env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the Ray runs only, e.g. GOMP_SPINCOUNT=1000 (repeatable; "
                        "Ray's workers get the OpenMP ones)")
    parser.add_argument("--modes", default="inline,ray", help=f"comma-separated, inline first: {', '.join(MODES)}")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--sets-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.workload, args.steps, json.loads(args.sets_json))))
        return
    both = parse_set(args.sets)
    ray_settings = deep_merge(deep_merge(both, {"run": RAY}), parse_set(args.ray_sets))
    modes = [m for m in args.modes.split(",") if m]
    if modes[:1] != ["inline"] or len(modes) < 2 or not set(modes) <= set(MODES):
        parser.error(f"--modes: inline first, then one or more of {', '.join(MODES[1:])}")
    settings = {m: both if m == "inline" else deep_merge(ray_settings, MODE_SETTINGS.get(m, {})) for m in modes}
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    ray_env = dict(item.split("=", 1) for item in args.ray_env)
    envs = {m: {} if m == "inline" else ray_env for m in modes}
    result: dict = {"environment": environment(), "steps": args.steps, "rounds": args.rounds, "modes": modes,
                    "settings": settings, "ray_env": ray_env}
    runs: dict = {w: {m: [] for m in modes} for w in workloads}
    for round_ in range(args.rounds):
        for workload in workloads:
            for mode in (modes if round_ % 2 == 0 else modes[::-1]):
                run = spawn(mode, workload, args.steps, settings[mode], envs[mode])
                runs[workload][mode].append(run)
                print(f"round {round_ + 1} {workload} {mode}: step {run['step_s']:.3f}s (rollout "
                      f"{run['rollout_s']:.3f}s, train {run['train_s']:.3f}s), load {run['load_avg_1m']:.1f}, "
                      f"pool per step {run['threads']}",
                      flush=True)
    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    for workload in workloads:
        a = runs[workload]["inline"]
        every = [x for m in modes for x in runs[workload][m]]
        result[workload] = {
            **runs[workload],
            "median": {m: {k: med(rs, k) for k in ("step_s", "rollout_s", "train_s", "setup_s")}
                       for m, rs in runs[workload].items()},
            "same_last_reward": all(abs(x["reward_mean_last"] - a[0]["reward_mean_last"]) < 1e-5 for x in every),
        }
        m = result[workload]["median"]
        for mode in modes[1:]:
            ratios = [rb["step_s"] / ra["step_s"] for ra, rb in zip(a, runs[workload][mode])]
            key = "" if mode == "ray" else f"_{mode}"  # "ray": the keys of earlier results
            result[workload][f"step_time_ratios{key}"] = ratios
            result[workload][f"step_time_ratio_median{key}"] = statistics.median(ratios)
            print(f"{workload}: step inline {m['inline']['step_s']:.3f}s {mode} {m[mode]['step_s']:.3f}s | ratio per "
                  f"round {', '.join(f'{x:.2f}' for x in ratios)}, median {statistics.median(ratios):.2f} | rollout "
                  f"{m['inline']['rollout_s']:.2f} vs {m[mode]['rollout_s']:.2f}s, train {m['inline']['train_s']:.2f} "
                  f"vs {m[mode]['train_s']:.2f}s")
        print(f"{workload}: same rewards in every run: {result[workload]['same_last_reward']}")
    print(f"wrote {write('ray_overhead', result)}")


if __name__ == "__main__":
    main()
