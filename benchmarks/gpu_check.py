"""GPU check: full-size Qwen-Image (random weights, bfloat16) trained with LoRA FlowGRPO at 512x512 through the
real loop (step-wise batched rollout, FSDP2 over one rank, nccl), with throughput, the step-time split and the
peak device memory beside the memory planner's prediction for the same config.

    python benchmarks/gpu_check.py                        # one H200: about 5-8 minutes
    python benchmarks/gpu_check.py --size tiny --device cpu --steps 2   # the same code at tiny size (tests)

Random weights: the released checkpoint is not needed (nor downloaded); every component is built from its
published configuration (omnirl_plugin_qwen_image.full_size) directly on the device. The model enters the run as
a model plugin registered here, a copy of qwen-image's spec whose factory builds that pipeline in memory.
Writes benchmarks/results/gpu_check-<size>.json (or --out).

    python benchmarks/gpu_check.py --sglang               # also the SGLang rollout engine (omnirl env build sglang
                                                          # --device cuda first): the tiny Qwen3-Omni thinker

``--sglang`` adds the SGLang engine's first GPU measurement: start time, the core's rollout-engine contract (per-
request seeds need SGLang's deterministic inference, GPU only), trainer-vs-SGLang log-probs plain / top-k / top-p,
and prefix sharing (prefill tokens computed and wall time for 4 prompts x 8 samples, plain sampling with
``share_prefixes`` off and on; ``benchmarks/sglang_prefix_sharing.py --device cuda`` measures more group shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results")
PLUGINS = ["omnirl_plugin_cpu", "omnirl_plugin_cuda", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
           "omnirl_plugin_diffusers", "omnirl_plugin_fsdp2", "omnirl_plugin_jpeg"]  # --sglang: the installed plugins
SIZES = {
    # full size, 512 px: 4 prompts x 8 samples a step, micro-batch 4, checkpointing, 10 steps with true CFG 4
    "full": {"rollout": {"height": 512, "width": 512, "num_steps": 10, "guidance_scale": 4.0, "prompts_per_step": 4,
                         "group_size": 8, "options": {"max_num_seqs": 8}},
             "model": {"lora": {"rank": 64, "alpha": 128}, "offload": "none",
                       "options": {"gradient_checkpointing": True, "max_sequence_length": 128}},
             "train": {"micro_batch_size": 4, "lr": 3e-4}},
    "tiny": {"rollout": {"height": 32, "width": 32, "num_steps": 4, "guidance_scale": 4.0, "prompts_per_step": 2,
                         "group_size": 4, "options": {"max_num_seqs": 8}},
             "model": {"preset": "tiny", "lora": {"rank": 8, "alpha": 8},
                       "options": {"gradient_checkpointing": True}},
             "train": {"micro_batch_size": 4, "lr": 1e-3}},
}


def random_pipeline(device: Any, dtype: Any) -> Any:
    """QwenImagePipeline with every component at its published size and random weights, built on ``device``."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from omnirl_plugin_qwen_image.full_size import TEXT_ENCODER, TRANSFORMER, VAE
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from omnirl_core.presets import qwen2_tokenizer

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the model dtype: no float32 copy on the way
    try:
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(**TRANSFORMER)
            vae = AutoencoderKLQwenImage(**VAE)
            text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**TEXT_ENCODER)).eval()
    finally:
        torch.set_default_dtype(previous)
    # the released scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return QwenImagePipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=qwen2_tokenizer(),
                             scheduler=scheduler)


def create_model(section: Any, options: Any, device: Any) -> Any:
    """The factory of the ``qwen-image-random`` model: the tiny preset, or the full-size random pipeline."""
    import torch
    from omnirl_plugin_qwen_image.model import QwenImageModel, QwenImageOptions
    from omnirl_plugin_qwen_image.model import create_model as create_qwen_image

    from omnirl_core.flow.model import DTYPES
    from omnirl_core.precision import concrete_dtype

    if section.preset == "tiny":
        return create_qwen_image(section, options, device)
    dtype = DTYPES[concrete_dtype(section.dtype, torch.device(device).type)]
    pipeline = random_pipeline(device, dtype)
    pipeline.set_progress_bar_config(disable=True)
    return QwenImageModel(pipeline, options or QwenImageOptions(), torch.device(device), dtype)


def manager() -> Any:
    """The plugins of the run, and ``qwen-image-random``: qwen-image's spec with the random-weight factory,
    registered by this script only."""
    from types import SimpleNamespace

    from omnirl_core import hookimpl
    from omnirl_core.plugins import PluginManager

    m = PluginManager()
    m.load_modules(PLUGINS)
    spec = dataclasses.replace(m.resolve("model", "qwen-image"), name="qwen-image-random", aliases=(),
                               factory=create_model, plugin="", version="")
    m.register(SimpleNamespace(omnirl_register_models=hookimpl(lambda register: register(spec))), "gpu-check")
    return m


def sglang_check(device: str) -> dict[str, Any]:
    """The SGLang rollout engine on the tiny Qwen3-Omni thinker (64-wide heads), on ``device``."""
    import torch

    from omnirl_core.ar.policy_gradient import AR_PLAN
    from omnirl_core.ar.sampling import completion_tokens
    from omnirl_core.config import LoraConfig, ModelSection
    from omnirl_core.contracts import GenRequest
    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.serving.envs import component_environment, is_built
    from omnirl_core.testing.engines import check_rollout_engine

    if not is_built(component_environment("sglang", device)):
        return {"skipped": f"omnirl env build sglang --device {device} first"}
    from omnirl_plugin_sglang.engine import SglangRolloutEngine, SglangRolloutOptions

    spec = get_plugin_manager().resolve("model", "qwen3-omni")
    model = spec.load_factory()(ModelSection(name="qwen3-omni", preset="tiny"), spec.load_config()(tiny_head_dim=64),
                                device)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)

    def engine(**options: Any) -> Any:
        return SglangRolloutEngine(model, SglangRolloutOptions(max_new_tokens=32, context_length=512, **options),
                                   torch.device(device))

    prompts = ["Hi there", "What is two plus two? Answer with a letter.", "Name a colour", "x"]
    group = [GenRequest(uid=i, prompt=prompts[i // 8], prompt_index=i // 8, group=i // 8, seed=i, height=0, width=0,
                        plan=AR_PLAN) for i in range(32)]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    plain = engine()
    plain.server  # noqa: B018 - starts SGLang
    out["start_s"] = round(time.perf_counter() - t0, 1)
    if device == "cuda":
        try:
            check_rollout_engine(lambda m: engine(), model)
            out["contract"] = "passed"
        except AssertionError as exc:
            out["contract"] = f"failed: {exc}"
    for name, options in {"plain": {}, "plain-unshared": {"share_prefixes": False},
                          "topk": {"temperature": 0.7, "top_k": 50}, "topp": {"temperature": 0.7, "top_p": 0.9}}.items():
        eng = engine(**options)
        eng.server.call("flush_cache")
        t0 = time.perf_counter()
        samples = list(eng.generate(group))
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            ours = model.token_logprobs([s.prompt_tokens for s in samples], [completion_tokens(s) for s in samples],
                                        [s.sampling for s in samples])
        stats = eng.last_stats
        out[name] = {"abs_delta_max": max(float((s.logprobs - o.float().cpu()).abs().max())
                                          for s, o in zip(samples, ours)),
                     "seconds": round(seconds, 2), "tokens": stats.get("tokens"),
                     "prompt_tokens": stats.get("prompt_tokens"), "cached_prompt_tokens": stats.get("cached_tokens"),
                     # the shared prompts prefilled first included (share_prefixes)
                     "prefill_tokens_computed": stats.get("prefill_tokens"),
                     "shared_prompts": stats.get("shared_prompts")}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--device", default="cuda", help="cuda (nccl) or cpu (gloo)")
    parser.add_argument("--steps", type=int, default=4, help="training steps; the first is warm-up")
    parser.add_argument("--device-memory", default=None, help="for the plan's verdict (default: the GPU's)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--sglang", action="store_true", help="also measure the SGLang rollout engine")
    args = parser.parse_args(argv)

    import torch

    from omnirl_core.config import deep_merge
    from omnirl_core.loop.controller import Controller
    from omnirl_core.planning.memory import device_memory
    from omnirl_core.planning.planner import parse_bytes, plan_memory
    from omnirl_core.resolve import resolve_run

    m = manager()
    cuda = args.device == "cuda"
    base = {"model": {"name": "qwen-image-random", "dtype": "bfloat16" if cuda else "float32"},
            "algorithm": {"name": "flowgrpo", "options": {"kl_convention": "flow_grpo", "noise_level": 1.2}},
            "train": {"engine": "fsdp2", "options": {"backend": "nccl" if cuda else "gloo"}},
            "rewards": [{"name": "jpeg"}], "data": {"prompts": "builtin:text"},
            "run": {"device": args.device, "executor": "inline", "steps": args.steps, "save_every": 10_000,
                    "sample_every": 10_000}}
    config = deep_merge(base, SIZES[args.size])
    with tempfile.TemporaryDirectory() as tmp:
        config["run"]["output_dir"] = tmp
        resolved = resolve_run(m, [config])
        memory = (parse_bytes(args.device_memory) if args.device_memory else device_memory("cuda")[0]) if cuda else None
        plan = plan_memory(resolved, memory, suggest=False) if args.size == "full" else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        controller = Controller(resolved, Path(tmp))
        controller.run_dir.prepare(resolved.dump(), [])
        summary = controller.run()
        total = time.perf_counter() - t0
        records = controller.run_dir.read_metrics()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    measured = records[1:] or records  # the first step warms up (kernels, allocator, embedding cache)
    samples = resolved.config.rollout.prompts_per_step * resolved.config.rollout.group_size

    def mean(key: str) -> float | None:
        values = [r[key] for r in measured if key in r]
        return sum(values) / len(values) if values else None

    step_s = mean("time/step_s")
    result = {
        "size": args.size, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "steps": summary.get("steps", len(records)), "wall_s": round(total, 1),
        "samples_per_step": samples, "resolution": [resolved.config.rollout.height, resolved.config.rollout.width],
        "img_per_gpu_s": samples / step_s if step_s else None,
        "step_s": step_s, "split_s": {k: mean(f"time/{k}_s") for k in ("rollout", "train", "sync", "collect")},
        "peak_memory_gib": peak / 2**30 if peak is not None else None,
        "plan": plan.as_dict() if plan is not None else None,
        "plan_total_gib": plan.peak / 2**30 if plan is not None else None,
        "reward_mean": [r.get("reward/mean") for r in records],
    }
    if args.sglang:
        result["sglang"] = sglang_check(args.device)
    out = Path(args.out) if args.out else RESULTS / f"gpu_check-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "plan"}, indent=2, default=str))
    if plan is not None:
        print(plan.table())
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
