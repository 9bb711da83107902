"""Where the training update spends its time: ``torch.profiler`` over omnirl's update on the reference-trainer work.

    python benchmarks/profile_update.py                              # micro-batch 4 (flow_grpo's), then the default
    python benchmarks/profile_update.py --micro 4,auto --steps 4 --top 15

The work is ``reference_trainer.py``'s (SD3.5 tiny preset, 64x64, 10 SDE steps, CFG 4.5, 16 images a step,
LoRA r 32, fp32, ``train.cfg_grad: cond``), run in this process through the CLI's code path (``api.train``).
The train engine's ``update`` of every step after the first is profiled on the CPU; the first step (one-time
costs) is left out. For each micro-batch setting it prints the top ops by self CPU time and the share of the
update they take, and writes ``benchmarks/results/profile_update.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train import environment, write
from reference_trainer import PROMPTS, omnirl_recipe


def profile(work: Path, micro: str, steps: int, threads: int, top: int) -> dict:
    import torch
    from omnirl_plugin_torch.engine import TorchTrainEngine
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from omnirl_core import api

    recipe = omnirl_recipe(work / "sd35-tiny", work / "prompts", steps, threads, "cond")
    recipe["train"]["micro_batch_size"] = int(micro) if micro.isdigit() else micro
    out = work / f"run-{micro}"
    recipe["run"]["output_dir"] = str(out)
    (work / f"{micro}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    original = TorchTrainEngine.update
    updates: list[float] = []
    prof = torch_profile(activities=[ProfilerActivity.CPU], record_shapes=False)

    def update(self, algorithm, units, step, reference=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        if step == 1:
            result = original(self, algorithm, units, step, reference)
        else:
            prof.start() if step == 2 else None
            result = original(self, algorithm, units, step, reference)
            updates.append(time.perf_counter() - t0)
            prof.stop() if step == steps else None
        return result

    TorchTrainEngine.update = update  # type: ignore[method-assign]
    try:
        api.train(str(work / f"{micro}.yaml"))
    finally:
        TorchTrainEngine.update = original  # type: ignore[method-assign]
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    ops = [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6 / (steps - 1), "calls": e.count // (steps - 1),
            "share": e.self_cpu_time_total / total} for e in rows]
    print(f"\nmicro_batch_size={micro}: update {sum(updates) / len(updates):.2f} s a step "
          f"(profiled, steps 2-{steps}; torch threads {torch.get_num_threads()})")
    for op in ops:
        print(f"  {op['share']:6.1%}  {op['self_cpu_s']:7.3f} s  {op['calls']:6d} calls  {op['op']}")
    return {"micro_batch_size": micro, "update_s": updates, "top_ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", default="4,auto", help="train.micro_batch_size settings, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    from omnirl_plugin_sd35.tiny import save_tiny

    work = Path(tempfile.mkdtemp(prefix="omnirl-profile-"))
    save_tiny(work / "sd35-tiny")
    (work / "prompts").mkdir()
    (work / "prompts" / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    result = {"environment": environment(), "steps": args.steps, "runs": []}
    for micro in args.micro.split(","):
        result["runs"].append(profile(work, micro.strip(), args.steps, args.threads, args.top))
    print("wrote", write("profile_update", result))


if __name__ == "__main__":
    main()
