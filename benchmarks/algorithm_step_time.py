"""Step time per algorithm on one tiny run: what MixGRPO's window, Flash's solver or NFT's log-prob-free
training save.

Every algorithm trains the same tiny Qwen-Image preset (random weights, LoRA r16) through the real
controller, inline executor: 4 prompts x 8 samples, 32x32, 8 denoising steps, the color reward. The
controllers run side by side in this process, one step each in turn, so machine load hits them alike;
each gets warm-up steps first. Reported per algorithm: seconds per step (rollout, train, total), model
calls per sample in the rollout and the training units (transitions, pairs or noise draws) per step.

    python benchmarks/algorithm_step_time.py              # about 4 minutes on 2 quiet cores
    python benchmarks/algorithm_step_time.py --steps 2 --warmup 1   # a quick check

Writes benchmarks/results/algorithm_step_time.json and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _train import environment, write

from omnirl_core.config import deep_merge
from omnirl_core.loop.controller import Controller
from omnirl_core.plugins import PluginManager
from omnirl_core.resolve import resolve_run

STEPS = 8
# name -> (algorithm, algorithm options); everything else is the shared tiny run
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "flowgrpo": ("flowgrpo", {}),
    "flowgrpo-cps": ("flowgrpo", {"sampler": "cps", "noise_level": 0.8}),
    "flowgrpo-fast (window 2)": ("flowgrpo", {"window": 2, "beta": 0.0}),
    "grpo-guard": ("grpo-guard", {}),
    "dancegrpo": ("dancegrpo", {}),
    "mixgrpo (window 2)": ("mixgrpo", {"window_size": 2}),
    "mixgrpo-flash (window 2, 3:1)": ("mixgrpo", {"window_size": 2, "flash": True, "flash_compression": 3}),
    "dpo (online)": ("dpo", {}),
    "nft": ("nft", {}),
}


def build(manager: PluginManager, out: Path, algo: str, options: dict[str, Any], threads: int) -> Controller:
    layer = {
        "model": {"name": "qwen-image", "preset": "tiny"},
        "algorithm": {"name": algo, "options": options},
        "rollout": {"num_steps": STEPS, "prompts_per_step": 4, "group_size": 8, "height": 32, "width": 32},
        "run": {"output_dir": str(out), "device": "cpu", "save_every": 10_000, "sample_every": 10_000,
                "reward_mode": "sync"},
    }
    resolved = resolve_run(manager, [deep_merge({}, layer)])
    ctl = Controller(resolved, out)
    ctl.run_dir.prepare(resolved.dump(), [])
    ctl.setup()
    counts: list[int] = []
    update = ctl.executor.update

    def counting(units: list[Any], step: int) -> dict[str, float]:
        counts.append(len(units))
        return update(units, step)

    ctl.executor.update = counting  # count the training units of each step
    ctl.unit_counts = counts  # type: ignore[attr-defined]
    return ctl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per algorithm")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    manager = PluginManager()
    manager.load_entry_points()
    variants = {k: v for k, v in VARIANTS.items() if args.only is None or k in args.only}
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        controllers = {name: build(manager, Path(tmp) / str(i), algo, opts, args.threads)
                       for i, (name, (algo, opts)) in enumerate(variants.items())}
        for step in range(1, args.warmup + args.steps + 1):
            for name, ctl in controllers.items():
                start = time.perf_counter()
                record = ctl.train_step(step)
                record["wall_s"] = time.perf_counter() - start
                record["nfe"] = ctl.algorithm.plan(step).num_steps
                if step > args.warmup:
                    records[name].append(record)
        units = {name: ctl.unit_counts[args.warmup:] for name, ctl in controllers.items()}
        for ctl in controllers.values():
            ctl.executor.close()

    rows = []
    for name, recs in records.items():
        rows.append({
            "variant": name,
            "algorithm": variants[name][0],
            "options": variants[name][1],
            "step_s": statistics.fmean(r["wall_s"] for r in recs),
            "step_s_stdev": statistics.stdev([r["wall_s"] for r in recs]) if len(recs) > 1 else 0.0,
            "rollout_s": statistics.fmean(r.get("time/rollout_s", float("nan")) for r in recs),
            "train_s": statistics.fmean(r["time/train_s"] for r in recs),
            "model_calls_per_sample": statistics.fmean(r["nfe"] for r in recs),
            "train_units_per_step": statistics.fmean(units[name]),
        })
    base = next((r["step_s"] for r in rows if r["variant"] == "flowgrpo"), None)
    for row in rows:
        row["vs_flowgrpo"] = row["step_s"] / base if base else None
    result = {"benchmark": "algorithm_step_time", "environment": environment(),
              "setup": {"model": "qwen-image tiny (LoRA r16)", "prompts_per_step": 4, "group_size": 8,
                        "resolution": 32, "num_steps": STEPS, "reward": "color", "measured_steps": args.steps,
                        "warmup_steps": args.warmup, "threads": args.threads},
              "rows": rows}
    path = write("algorithm_step_time", result)
    print(f"{'variant':32s} {'step s':>8s} {'rollout s':>10s} {'train s':>8s} {'calls/sample':>13s} "
          f"{'units/step':>11s} {'x flowgrpo':>10s}")
    for r in rows:
        rel = f"{r['vs_flowgrpo']:.2f}" if r["vs_flowgrpo"] else "-"
        print(f"{r['variant']:32s} {r['step_s']:8.3f} {r['rollout_s']:10.3f} {r['train_s']:8.3f} "
              f"{r['model_calls_per_sample']:13.1f} {r['train_units_per_step']:11.1f} {rel:>10s}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
