"""Device check for a GPU machine: full-size Qwen-Image through vllm-omni next to the diffusers engine.

    omnirl env build vllm-omni --device cuda
    python plugins/engines/vllm-omni/gpu_check.py --model /path/to/Qwen-Image [--size 1024 --steps 10 --batch 8]

Loads the checkpoint once in this process (bf16; the trainer side and the diffusers engine) and once in
vllm-omni's server process, so it needs memory for two copies (about 2 x 58 GB: one H200, or two GPUs with
CUDA_VISIBLE_DEVICES split by the caller). For each engine: one warm-up batch, then ``--repeats`` batches of
``--batch`` requests (FlowGRPO plan: SDE steps, last step ODE); reports seconds per denoising step (batch),
images per GPU-second, and the largest per-step log-prob difference between the engines on the same seeds
(bf16: expect ~1e-2, not the CPU fp32 bound). Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Local Qwen-Image directory (diffusers layout).")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("vllm_omni_gpu_check.json"))
    args = parser.parse_args()

    import torch
    from omnirl_plugin_vllm_omni.engine import VllmOmniRolloutEngine, VllmOmniRolloutOptions

    from omnirl_core.config import LoraConfig, ModelSection
    from omnirl_core.contracts import GenRequest, RolloutPlan
    from omnirl_core.plugins import get_plugin_manager

    # the other components through the registry (a plugin imports no other plugin)
    plugins = get_plugin_manager()
    create_model = plugins.resolve("model", "qwen-image").load_factory()
    diffusers = plugins.resolve("engine", "diffusers")
    DiffusersRolloutEngine, DiffusersRolloutOptions = diffusers.load_factory(), diffusers.load_config()

    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    model = create_model(ModelSection(name="qwen-image", path=args.model, dtype=args.dtype), None, "cuda")
    model.setup_training(LoraConfig(rank=64, alpha=64), need_reference=False)
    plan = RolloutPlan(step_kinds=("sde",) * (args.steps - 1) + ("ode",), train_steps=tuple(range(args.steps - 1)),
                       eta=0.7)
    requests = [GenRequest(uid=i, prompt=f"a photo of {i} red apples on a table", prompt_index=i, group=i,
                           seed=10 + i, height=args.size, width=args.size, plan=plan) for i in range(args.batch)]
    engines = {
        "vllm-omni": VllmOmniRolloutEngine(model, VllmOmniRolloutOptions(max_num_seqs=args.batch), "cuda"),
        "diffusers": DiffusersRolloutEngine(model, DiffusersRolloutOptions(max_num_seqs=args.batch), "cuda"),
    }
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "gpu": torch.cuda.get_device_name()}
    samples = {}
    for name, engine in engines.items():
        list(engine.generate(requests))
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            samples[name] = {s.request.uid: s for s in engine.generate(requests)}
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        report[name] = {"seconds": times, "step_s": median / args.steps, "img_per_gpu_s": args.batch / median}
        print(f"{name}: {median / args.steps:.3f} s/step (batch {args.batch}), {args.batch / median:.3f} img/GPU/s")
    delta = max(float((samples["vllm-omni"][u].logprobs[:-1] - samples["diffusers"][u].logprobs[:-1]).abs().max())
                for u in samples["diffusers"])
    report["logprob_max_abs_delta"] = delta
    report["speedup_vllm_omni"] = report["vllm-omni"]["img_per_gpu_s"] / report["diffusers"]["img_per_gpu_s"]
    args.out.write_text(json.dumps(report, indent=2))
    print(f"log-prob max |delta| {delta:.3g}; vllm-omni / diffusers throughput {report['speedup_vllm_omni']:.2f}")


if __name__ == "__main__":
    main()
