"""Run in an environment whose transformers has the thinker's flat layout (the veomni environment: transformers 5.9):
the tiny preset loads, scores, trains LoRA and writes its adapter under the nested layout's names. Prints one JSON
line of findings; ``--reference DIR`` compares with the files the project's environment wrote there."""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
import transformers
from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model, nested_name

from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.ar.sampling import SamplingParams
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", required=True)
    parser.add_argument("--audio", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=args.preset), Qwen3OmniOptions(), "cpu")
    targets = model.lora_target_names(None)
    model.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    with torch.no_grad():  # adapters that matter, the same in either layout (seeded by the nested name)
        for name, param in model.module.named_parameters():
            if "lora_" in name:
                key = nested_name(name) if model.flat else name
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))))
    requests = [GenRequest(uid=i, prompt=text, prompt_index=i, group=i, seed=i, height=0, width=0, plan=AR_PLAN,
                           inputs=inputs)
                for i, (text, inputs) in enumerate([("Which letter?", {}), ("What do you hear?", {"audio": args.audio})])]
    prompts = [model.encode_prompt(r) for r in requests]
    completions = [torch.tensor([model.token_id(c) for c in "ABCD"]) for _ in requests]
    scored = model.token_logprobs(prompts, completions, [SamplingParams(temperature=1.0)] * len(requests))
    forward = []  # the thinker's own forward (its output head over every position)
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            seq = torch.cat([p.input_ids, c])[None]
            inputs = {"input_ids": seq, "attention_mask": torch.ones_like(seq), **model.media_inputs([p.media])}
            logits = model.module(**inputs, use_cache=False).logits[0, len(p.input_ids) - 1:-1].float()
            forward.append(torch.log_softmax(logits, -1).gather(-1, c[:, None])[:, 0])
    sum(s.sum() for s in scored).backward()
    grads = sorted(nested_name(n) if model.flat else n for n, p in model.module.named_parameters()
                   if p.grad is not None)
    model.save_trained(out / "adapter")
    model.load_trained(out / "adapter")
    print(json.dumps({
        "transformers": transformers.__version__, "flat": model.flat, "targets": targets,
        "called": [type(m).__name__ for m in model.called_submodules()],
        "scored_vs_forward": max(float((a - b).abs().max()) for a, b in zip(scored, forward)),
        "scored": [s.tolist() for s in scored], "grads": grads,
        "state": sorted(model.trained_state_dict()),
        "adapter_targets": sorted(json.loads((out / "adapter" / "adapter_config.json").read_text())["target_modules"]),
    }))


if __name__ == "__main__":
    main()
