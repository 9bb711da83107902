"""A run over a 3-node Ray cluster against the same run on one Ray node: step time, and the bytes that cross between
nodes per step (weights, samples, checkpoint).

    python benchmarks/ray_cluster.py [--steps 4] [--rounds 1]

The tiny FlowGRPO run of ``tests/test_cluster.py``: Qwen-Image tiny preset with LoRA, a rollout worker, two FSDP2
ranks (gloo), the colour reward, 1 torch thread per worker. ``single``: a local Ray instance (one node, every
actor on it). ``cluster``: a local cluster of real raylets (``ray.cluster_utils.Cluster``), a head and two worker
nodes of 1 CPU each: the rollout on the head (beside the driver), one rank on each worker node, the reward beside
rank 1. Each case's driver is a process of its own; rounds alternate which goes first.

What crosses between nodes is counted in the driver from what each phase moves and where its actors run
(``runtime.json``): the samples (rollout node -> driver), the reward views (rollout node -> reward node), the
update's units (driver -> each train node), the LoRA weights (rank 0's node -> the rollout's), a checkpoint (each
rank's part -> the driver). Sizes are the pickled objects (what Ray's serialization writes, to a few bytes). On one
node the same bytes go through Ray's object store but no network: they are reported as ``moved`` beside
``between_nodes``.

Also computes what the weight sync would move per step on 8 GPU nodes for the real Qwen-Image (LoRA rank 64 as in
``recipes/qwen-image/*-lora-8gpu.yaml``, and full fine-tuning in bfloat16), from ``omnirl plan``'s sizes.
Writes ``benchmarks/results/ray_cluster.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUN = {
    "model": {"name": "qwen-image", "preset": "tiny", "lora": {"rank": 4, "alpha": 4}},
    "algorithm": {"name": "flowgrpo"},
    "rewards": [{"name": "color"}],
    "rollout": {"prompts_per_step": 2, "group_size": 4, "num_steps": 3, "height": 32, "width": 32},
    "train": {"engine": "fsdp2", "lr": 0.01, "minibatches": 2, "micro_batch_size": 8},
    "run": {"seed": 11, "device": "cpu", "executor": "ray", "placement": "split", "train_workers": 2,
            "worker_cpus": 0.5, "threads": 1, "sample_every": 10_000},
}
POOLS = {"rollout": {"resources": {"rollout": 0.001}},
         "train": {"strategy": "strict_spread", "resources": {"train": 0.001}},
         "reward": {"resources": {"reward": 0.001}}}


def size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=5))


def child(case: str, address: str | None, steps: int, out: Path) -> dict[str, Any]:
    """One run, this process its driver: per step its time and what each phase moved (``--child``)."""
    from omnirl_core.api import train
    from omnirl_core.config import deep_merge
    from omnirl_core.loop import executors
    from omnirl_core.loop.ray_executor import RayExecutor, reward_view

    moved: list[dict[str, float]] = []
    current: dict[str, float] = {}
    where: dict[str, str] = {}

    class Measured(RayExecutor):
        """The Ray executor, counting the bytes of what each phase sends (benchmark instrumentation)."""

        def setup(self):
            import ray

            super().setup()
            where["driver"] = ray.get_runtime_context().get_node_id()

        def rollout(self, requests, evaluation=False):
            samples, metrics = super().rollout(requests, evaluation)
            current["samples"] = float(sum(size(s) for s in samples))
            current["views"] = float(sum(size(reward_view(s)) for s in samples))
            return samples, metrics

        def update(self, units, step):
            current["units"] = float(size(units))
            return super().update(units, step)

        def sync_weights(self, evaluation=False):
            metrics = super().sync_weights(evaluation)
            if "sync/bytes" in metrics and "units" in current:  # after an update (not the start's sync)
                current["weights"] = metrics["sync/bytes"]
            return metrics

        def save_state(self, directory):
            start = time.perf_counter()
            files = super().save_state(directory)
            current["checkpoint_s"] = time.perf_counter() - start
            current.update({f"checkpoint_rank{r}": float(b)
                            for r, b in enumerate(self.traffic["checkpoint_bytes_by_rank"])})
            moved.append(dict(current))
            current.clear()
            return files

    executors.EXECUTORS["ray"] = Measured
    config = deep_merge(RUN, {"run": {"steps": steps, "save_every": 1, "output_dir": str(out),
                                      **({"ray_address": address, "ray_pools": POOLS} if address else {})}})
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    train(config, on_step=rows.append)
    wall = time.perf_counter() - start
    runtime = json.loads((out / "runtime.json").read_text())["ray"]
    return {"case": case, "rows": rows, "moved": moved, "groups": runtime["groups"], "driver_node": where["driver"],
            "wall_s": wall}


def crossing(result: dict[str, Any]) -> dict[str, Any]:
    """Per step (after the first), the bytes each phase moved and those of them that crossed between nodes."""
    groups, driver = result["groups"], result["driver_node"]
    rollout = groups["rollout"][0]["node_id"]
    train = [m["node_id"] for m in groups["train"]]
    rewards = {m["node_id"] for m in groups["reward"]}
    steps = result["moved"][1:] or result["moved"]
    per_step: dict[str, dict[str, float]] = {}
    for name in ("samples", "views", "units", "weights", "checkpoint"):
        total, between = [], []
        for m in steps:
            if name == "checkpoint":
                parts = [m.get(f"checkpoint_rank{r}", 0.0) for r in range(len(train))]
                total.append(sum(parts))
                between.append(sum(p for p, node in zip(parts, train) if node != driver))
            else:
                value = m.get(name, 0.0)
                total.append(value)
                hops = {"samples": int(rollout != driver),
                        "views": int(any(node != rollout for node in rewards)),
                        "units": len({node for node in train if node != driver}),  # one copy per node
                        "weights": int(train[0] != rollout)}[name]
                between.append(value * hops)
        per_step[name] = {"moved": statistics.fmean(total), "between_nodes": statistics.fmean(between)}
    step_s = [r["time/step_s"] for r in result["rows"][1:]] or [r["time/step_s"] for r in result["rows"]]
    checkpoint_s = [m["checkpoint_s"] for m in steps]
    return {
        "step_s": statistics.fmean(step_s), "step_s_each": step_s,
        "checkpoint_s": statistics.fmean(checkpoint_s),
        "bytes_per_step": per_step,
        "between_nodes_per_step": sum(v["between_nodes"] for k, v in per_step.items() if k != "checkpoint"),
        "nodes": {"driver": driver[:12], "rollout": rollout[:12], "train": [n[:12] for n in train],
                  "reward": sorted(n[:12] for n in rewards)},
    }


def implied_for_8_gpu_nodes() -> dict[str, Any]:
    """The weight sync of the real Qwen-Image per step (``omnirl plan``'s sizes): LoRA rank 64 (fp32 master, what
    the sync sends) and the full transformer in bfloat16, and its time over a few link speeds."""
    from omnirl_core import plan

    def rows(lora: dict[str, Any]) -> dict[str, int]:
        config = {"model": {"name": "qwen-image", "dtype": "bfloat16", "lora": lora}, "algorithm": {"name": "flowgrpo"},
                  "run": {"device": "cpu"}}
        planned = plan(config, device_memory="10000GiB").as_dict()
        return planned["groups"][0]["rows"]

    lora = rows({"enabled": True, "rank": 64, "alpha": 128})["adapters (fp32 master)"]
    full = rows({"enabled": False})["weights/transformer"]
    links = {"100 Gb/s": 12.5e9, "200 Gb/s": 25e9, "400 Gb/s (8x50 GB/s NVLink excluded)": 50e9}
    return {"lora_rank64_bytes": lora, "full_bf16_bytes": full,
            "seconds_per_copy": {name: {"lora": lora / bw, "full": full / bw} for name, bw in links.items()},
            "note": "one copy per rollout node that is not rank 0's node (rank 0 sends, or a broadcast tree)"}


def start_cluster(base: Path) -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    for name, resources in (("head", {"rollout": 1}), ("a", {"train": 1}), ("b", {"train": 1, "reward": 1})):
        cluster.add_node(num_cpus=1, resources=resources, temp_dir=str(base / f"t-{name}"))
    return cluster


def run_child(case: str, address: str | None, steps: int, base: Path) -> dict[str, Any]:
    out = base / f"{case}-{time.monotonic_ns()}"
    result = base / f"{out.name}.json"
    cmd = [sys.executable, __file__, "--child", case, "--steps", str(steps), "--out", str(out), "--json", str(result)]
    if address:
        cmd += ["--address", address]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=base)
    if proc.returncode != 0:
        raise SystemExit(f"{case} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", choices=["single", "cluster"])
    parser.add_argument("--address")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        args.json.write_text(json.dumps(child(args.child, args.address, args.steps, args.out)))
        return
    base = Path(tempfile.mkdtemp(prefix="orl-bench-", dir="/tmp"))  # short: Ray's socket paths live below it
    (base / "rt" / "ray").mkdir(parents=True)
    os.environ["RAY_TMPDIR"] = str(base / "rt")  # the cluster's address file: not /tmp/ray, where others look
    cluster = start_cluster(base)
    cases: dict[str, list[dict[str, Any]]] = {"single": [], "cluster": []}
    try:
        for i in range(args.rounds):
            order = ["single", "cluster"] if i % 2 == 0 else ["cluster", "single"]
            for case in order:
                raw = run_child(case, cluster.address if case == "cluster" else None, args.steps, base)
                cases[case].append(crossing(raw))
                print(f"{case}: {cases[case][-1]['step_s']:.2f} s/step, "
                      f"{cases[case][-1]['between_nodes_per_step'] / 1e3:.1f} kB/step between nodes", flush=True)
    finally:
        cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    summary = {case: {"step_s": statistics.median(r["step_s"] for r in runs),
                      "checkpoint_s": statistics.median(r["checkpoint_s"] for r in runs),
                      "between_nodes_per_step": statistics.median(r["between_nodes_per_step"] for r in runs)}
               for case, runs in cases.items()}
    result = {
        "environment": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                        "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "steps": args.steps, "rounds": args.rounds, "runs": cases, "summary": summary,
        "cluster_over_single_step": summary["cluster"]["step_s"] / summary["single"]["step_s"],
        "qwen_image_8_gpu_nodes": implied_for_8_gpu_nodes(),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "ray_cluster.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("summary", "cluster_over_single_step", "qwen_image_8_gpu_nodes")},
                     indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
