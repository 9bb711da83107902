"""Does the torch thread count change what a run computes? Each model's tiny preset trained through the CLI on
1 and on 2 threads (``run.threads``), the same seed, then every tensor of the two final checkpoints compared.

    python benchmarks/thread_invariance.py                      # every pair below, about 6 minutes on 2 cores
    python benchmarks/thread_invariance.py --only bagel:flowgrpo --steps 5
    python benchmarks/thread_invariance.py --only qwen-image:flowgrpo --set rollout.prompts_per_step=2 \
        --set rollout.group_size=4                              # another batch shape

Why it matters: the default thread policy (``run.threads: adaptive``) gives up a thread while the machine is
loaded. Where a model's arithmetic does not depend on the count, that changes nothing but the speed; where it
does (a reduction split over threads), the numbers then follow the load, and only a fixed count keeps a run
reproducible bit for bit. Writes ``benchmarks/results/thread_invariance.json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIRS = ("qwen-image:flowgrpo", "qwen-image:dpo", "qwen-image:nft", "qwen-image:mixgrpo", "sd35:flowgrpo",
         "sd35:dancegrpo", "flux:flowgrpo", "wan22:flowgrpo", "bagel:flowgrpo", "qwen3-omni:gspo")


def train(model: str, algo: str, threads: int, out: Path, steps: int, extra: list[str]) -> Path:
    script = Path(sys.executable).with_name("omnirl")  # the console script of this environment
    cmd = [str(script) if script.exists() else "omnirl", "train", "--model", model, "--algo", algo, "--preset", "tiny",
           "--steps", str(steps), "--output-dir", str(out), "--set", f"run.threads={threads}",
           "--set", f"run.save_every={steps}", "--set", f"run.sample_every={10 * steps}"]
    for item in extra:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{model} {algo} on {threads} thread(s) failed:\n{proc.stderr[-3000:]}")
    return out / "checkpoints" / f"step-{steps:06d}"


def compare(a: Path, b: Path) -> dict[str, float | int | bool]:
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    tensors = differing = 0
    largest = 0.0
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        for key, value in x.items():
            tensors += 1
            if not torch.equal(value, y[key]):
                differing += 1
                largest = max(largest, (value.double() - y[key].double()).abs().max().item())
    return {"files": len(files), "tensors": tensors, "differing": differing, "max_abs_diff": largest,
            "identical": tensors > 0 and differing == 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="MODEL:ALGO pairs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (e.g. rollout.group_size=4); repeatable")
    parser.add_argument("--tag", default="", help="written to thread_invariance-TAG.json instead")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from _train import environment, write

    result: dict[str, object] = {"steps": args.steps, "overrides": args.set, "load_avg_1m_before": os.getloadavg()[0], "pairs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.only or PAIRS:
            model, algo = pair.split(":")
            one, two = (train(model, algo, n, Path(tmp) / f"{model}-{algo}-{n}", args.steps, args.set) for n in (1, 2))
            result["pairs"][pair] = row = compare(one, two)  # type: ignore[index]
            verdict = "identical" if row["identical"] else f"{row['differing']} of {row['tensors']} tensors differ, " \
                                                           f"largest by {row['max_abs_diff']:.3g}"
            print(f"{pair:>22}: {verdict}", flush=True)
    result["environment"] = environment()
    print(f"wrote {write('thread_invariance' + (f'-{args.tag}' if args.tag else ''), result)}")


if __name__ == "__main__":
    main()
