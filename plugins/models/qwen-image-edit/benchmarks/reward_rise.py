"""Does a run's training reward rise? First vs last ``--window`` steps of its metrics.jsonl (default 10): the two
means, their difference, the standard error of the difference (the steps as independent draws: sqrt(var_first / n +
var_last / n)) and the difference in standard errors; and the rise of the least-squares line through every step,
with its standard error; for ``reward/mean`` and each reward's ``reward/<name>``.

    python plugins/models/qwen-image-edit/benchmarks/reward_rise.py RUN_DIR [RUN_DIR ...] [--window 10]

RUN_DIR is a run directory (``omnirl train -o RUN_DIR``) or its metrics.jsonl. Prints one line per metric; reads
files only (no torch), so it needs no lock."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def rise(values: list[float], window: int) -> tuple[float, float, float]:
    """(mean of the first ``window`` values, mean of the last ``window``, standard error of their difference)."""
    if len(values) < 2 * window:
        raise ValueError(f"{len(values)} steps: need at least {2 * window} for two windows of {window}")
    first, last = values[:window], values[-window:]
    se = math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
    return statistics.fmean(first), statistics.fmean(last), se


def trend(values: list[float]) -> tuple[float, float]:
    """The least-squares line through all steps: its rise from the first step to the last, and that rise's standard
    error (the steps as independent draws around the line). Uses every step, not two windows of ten."""
    n = len(values)
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, values)) / (n - 2)
    return slope * (n - 1), math.sqrt(residual / sxx) * (n - 1)


def read_metrics(path: Path) -> list[dict]:
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no metrics.jsonl (give a run directory of `omnirl train -o DIR`)")
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=10)
    args = parser.parse_args(argv)
    for run in args.runs:
        try:
            records = read_metrics(run)
        except (FileNotFoundError, json.JSONDecodeError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        names = [k for k in records[0] if k.startswith("reward/") and k.count("/") == 1 and not k.endswith("_frac")
                 and k not in ("reward/mean", "reward/std")]
        keys = ["reward/mean", *sorted(names)]
        print(f"{run}: {len(records)} steps, first vs last {args.window}")
        for key in keys:
            values = [float(r[key]) for r in records if key in r and math.isfinite(float(r[key]))]
            try:
                first, last, se = rise(values, args.window)
            except ValueError as error:
                print(f"  {key}: {error}")
                continue
            diff = last - first
            ratio = f"{diff / se:+.1f} SE" if se > 0 else "no spread"
            fitted, fitted_se = trend(values)
            fit = f"{fitted / fitted_se:+.1f} SE" if fitted_se > 0 else "no spread"
            print(f"  {key}: {first:.4f} -> {last:.4f}, {diff:+.4f} +- {se:.4f} ({ratio}); "
                  f"line over all {len(values)} steps {fitted:+.4f} +- {fitted_se:.4f} ({fit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
