"""Rollout correction: recompute vs bypass old log-probs, side by side in one run (alternating steps).

    python benchmarks/bypass.py [--steps 3]

Tiny Qwen-Image preset with FlowGRPO (its defaults: 4 prompts x 8 samples, 6 steps, 5 trained). Per mode:
step and train time, the |delta logp| between trainer and rollout (mean / max over trained steps), the IS
diagnostics and the RS mask's rejected fraction (band run.train.rs_band, default [0.5, 2]). On CPU fp32 the
rollout and the trainer share one code path, so |delta| is ~0 and nothing is rejected; what bypass buys is
the recompute forward. Writes ``benchmarks/results/bypass.json``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _train import controller, environment, mean, write

KEYS = ("time/step_s", "time/train_s", "logprob/abs_delta_mean", "logprob/abs_delta_max", "is/kl_k3", "is/ess",
        "is/seq_weight_max", "rs/rejected_frac", "rs/corrected_units")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per mode after one warm-up step")
    args = parser.parse_args()
    ctl = controller(Path(tempfile.mkdtemp(prefix="omnirl-bench-")), {"rewards": [{"name": "color"}]})
    ctl.setup()
    ctl.train_step(1)
    records = {"recompute": [], "bypass": []}
    for i in range(2 * args.steps):
        mode = ("recompute", "bypass")[i % 2]
        ctl.set_old_logprob(mode)  # the run-time switch: the controller's and every actor's algorithm
        records[mode].append(ctl.train_step(2 + i))
    ctl.executor.close()
    result = {"environment": environment(), "samples_per_step": len(ctl.requests(1)),
              "rs_band": list(ctl.cfg.train.rs_band or []),
              **{mode: {k: mean(recs, k) for k in KEYS} | {"steps": len(recs)} for mode, recs in records.items()}}
    r, b = result["recompute"], result["bypass"]
    result["train_time_saved_frac"] = 1 - b["time/train_s"] / r["time/train_s"]
    result["step_time_saved_frac"] = 1 - b["time/step_s"] / r["time/step_s"]
    path = write("bypass", result)
    for mode in ("recompute", "bypass"):
        m = result[mode]
        print(f"{mode:9s} step {m['time/step_s']:.2f}s train {m['time/train_s']:.2f}s |delta| mean "
              f"{m['logprob/abs_delta_mean']:.2e} max {m['logprob/abs_delta_max']:.2e} rejected "
              f"{m['rs/rejected_frac']:.3f}")
    print(f"bypass saves {result['train_time_saved_frac']:.1%} of train time, {result['step_time_saved_frac']:.1%} "
          f"of step time; wrote {path}")


if __name__ == "__main__":
    main()
