"""True CFG without grad: both branches in one batched call (omnirl's since 07c3e1a) vs two calls (before).

    python benchmarks/cfg_batching.py [--reps 20] [--pairs 4]      # about 4 minutes

On ``end_to_end.py``'s ``small`` configuration (the 8-layer transformer, 64 px, 10 steps, CFG 4.5, 4 prompts
x 4, two minibatches of micro-batches of 8, KL 0.04; the tiny preset samples without CFG), in one process:
- per call: ``model.velocity`` under no_grad at the rollout's batch (every sample) and at the update's
  micro-batch, each way back to back, the order alternating, ``--reps`` times; medians;
- per step: FlowGRPO steps through the real controller, alternating the two ways step by step (``--pairs``
  pairs after a warm-up step each), medians of the step and of its rollout and train phases.
"Two calls" is the code before the change: the same ``guided_velocity`` with no ``forward_pair``.
Writes ``benchmarks/results/cfg_batching.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _train import environment, write  # first: the thread policy is set before torch loads

import omnirl_core.flow.model as flow_model

BATCHED = flow_model.guided_velocity


def _two_calls(forward: Any, cond: Any, uncond: Any, guidance_scale: float, renorm: bool = False,
               forward_pair: Any = None) -> Any:
    return BATCHED(forward, cond, uncond, guidance_scale, renorm, None)


@contextmanager
def way(name: str):
    """``batched`` (omnirl's) or ``two_calls`` (before): which ``guided_velocity`` the models call."""
    flow_model.guided_velocity = BATCHED if name == "batched" else _two_calls
    try:
        yield
    finally:
        flow_model.guided_velocity = BATCHED


def per_call(ctl: Any, reps: int) -> dict[str, Any]:
    import torch

    cfg = ctl.resolved.config
    model = ctl.executor.worker.model
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    micro = cfg.train.micro_batch_size
    prompts = [f"prompt {i}" for i in range(n)]
    cond = model.encode(prompts)
    uncond = model.encode([cfg.rollout.negative_prompt] * n)
    torch.manual_seed(0)
    x = torch.randn(n, *model.latent_shape(cfg.rollout.height, cfg.rollout.width, None))
    s = torch.full((n,), 0.5)
    out: dict[str, Any] = {}
    for label, rows in (("rollout", n), ("micro_batch", micro)):
        idx = list(range(rows))
        args = (x[:rows], s[:rows], cond.select(idx), cfg.rollout.guidance_scale, uncond.select(idx))
        times: dict[str, list[float]] = {"batched": [], "two_calls": []}
        with torch.no_grad():
            for name in times:  # warm-up
                with way(name):
                    model.velocity(*args)
            for rep in range(reps):
                for name in (("batched", "two_calls") if rep % 2 == 0 else ("two_calls", "batched")):
                    with way(name):
                        t0 = time.perf_counter()
                        model.velocity(*args)
                        times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[label] = {"rows": rows, "batched_s": med["batched"], "two_calls_s": med["two_calls"],
                      "speedup": med["two_calls"] / med["batched"]}
    return out


def per_step(ctl: Any, pairs: int) -> dict[str, Any]:
    rows: dict[str, list[dict[str, float]]] = {"batched": [], "two_calls": []}
    step = 1
    for name in rows:  # a warm-up step each
        with way(name):
            ctl.train_step(step)
        step += 1
    for pair in range(pairs):
        for name in (("batched", "two_calls") if pair % 2 == 0 else ("two_calls", "batched")):
            with way(name):
                record = ctl.train_step(step)
            rows[name].append(record)
            step += 1
    out: dict[str, Any] = {}
    for name, records in rows.items():
        out[name] = {key.split("/")[1]: statistics.median(r[key] for r in records)
                     for key in ("time/step_s", "time/rollout_s", "time/train_s")}
        out[name]["steps"] = [r["time/step_s"] for r in records]
    out["step_speedup"] = out["two_calls"]["step_s"] / out["batched"]["step_s"]
    out["pair_speedups"] = [a["time/step_s"] / b["time/step_s"] for a, b in zip(rows["two_calls"], rows["batched"])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per way and batch size")
    parser.add_argument("--pairs", type=int, default=4, help="(batched, two-call) step pairs")
    args = parser.parse_args()
    import os

    from end_to_end import build

    result: dict[str, Any] = {"environment": environment(), "config": "small"}
    with tempfile.TemporaryDirectory() as tmp:
        ctl = build("small", Path(tmp), 10_000)
        result["guidance_scale"] = ctl.resolved.config.rollout.guidance_scale
        result["per_call"] = per_call(ctl, args.reps)
        result["per_step"] = per_step(ctl, args.pairs)
        ctl.executor.close()
        ctl.run_dir.unlock()
    result["load_avg_1m_after"] = os.getloadavg()[0]
    for label, r in result["per_call"].items():
        print(f"{label} ({r['rows']} rows): batched {1000 * r['batched_s']:.1f} ms, two calls "
              f"{1000 * r['two_calls_s']:.1f} ms: {r['speedup']:.2f}x")
    s = result["per_step"]
    print(f"step: batched {s['batched']['step_s']:.3f} s (rollout {s['batched']['rollout_s']:.3f}, train "
          f"{s['batched']['train_s']:.3f}), two calls {s['two_calls']['step_s']:.3f} s (rollout "
          f"{s['two_calls']['rollout_s']:.3f}, train {s['two_calls']['train_s']:.3f}): {s['step_speedup']:.2f}x; "
          f"pairs {', '.join(f'{x:.2f}' for x in s['pair_speedups'])}")
    print(f"wrote {write('cfg_batching', result)}")


if __name__ == "__main__":
    main()
