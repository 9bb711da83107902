"""The vLLM rollout server: ``python -m omnirl_plugin_vllm.server --model DIR [--dtype float32] [--max-num-seqs 64]
[--max-model-len 4096] [--seed 0] [--gpu-memory-utilization 0.5]``, run by the engine in the vLLM environment (see ``engine.py``).

Calls (``omnirl_core.serving.rollout_server``): ``generate`` (prompt token ids + sampling settings per request
-> the sampled tokens and the log-prob of each under the distribution it was drawn from), ``load_weights``
(weights in the checkpoint's names, through vLLM's in-place reload), ``packed_modules`` (the model's fused
layers), ``info``.

Log-probs are vLLM's ``processed_logprobs``: after the allowed-token mask, temperature and top-k / top-p, the
log-softmax of what the token was sampled from, which is what the trainer re-scores
(``omnirl_core.ar.sampling.sampling_logprobs``). The checkpoint's generation_config.json is ignored
(``generation_config='vllm'``): no repetition penalty or other default changes the distribution.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any

import torch

from omnirl_core.serving.rollout_server import pack, serve, server_args

WORKER_EXTENSION = "omnirl_plugin_vllm.worker.OmnirlWorkerExtension"


class RolloutServer:
    def __init__(self, model: str, dtype: str = "float32", max_num_seqs: int = 64, max_model_len: int = 4096,
                 seed: int = 0, gpu_memory_utilization: float | None = None):
        self.model = model
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.seed = seed
        self.gpu_memory_utilization = gpu_memory_utilization
        self.llm: Any = None
        self.weights_version = 0

    def start(self) -> None:
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        self.llm = LLM(model=self.model, dtype=self.dtype, max_num_seqs=self.max_num_seqs,
                       max_model_len=self.max_model_len, seed=self.seed, enforce_eager=True,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       worker_extension_cls=WORKER_EXTENSION, **kwargs)

    def generate(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        from vllm import SamplingParams

        s = meta["sampling"]
        prompts, params = [], []
        for r in meta["requests"]:
            ids = tensors[f"{r['uid']}.prompt_ids"].tolist()
            prompts.append({"prompt_token_ids": ids})
            # the stop tokens are ours alone (ignore_eos: the tokenizer's eos is not added); logprobs=0: the
            # sampled token's log-prob only
            params.append(SamplingParams(
                n=1, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"], max_tokens=s["max_new_tokens"],
                seed=int(r["seed"]), logprobs=0, stop_token_ids=list(s["stop_token_ids"]), ignore_eos=True,
                allowed_token_ids=s["allowed_token_ids"], detokenize=False, skip_special_tokens=False))
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        out: dict[str, Any] = {}
        for r, output in zip(meta["requests"], outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(completion.logprobs or [])} log-probs for {len(tokens)} "
                                   f"tokens (request {r['uid']})")
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
            out[f"{r['uid']}.tokens"] = torch.tensor(tokens, dtype=torch.long)
            out[f"{r['uid']}.logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
        tokens_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"stats": {"seconds": seconds, "requests": len(prompts), "tokens": tokens_out}}, out

    def load_weights(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        (loaded,) = set(self.llm.collective_rpc("omnirl_load_weights", args=(pack({}, tensors),)))
        self.weights_version += 1
        # cached prefixes were computed with the old weights
        self.llm.reset_prefix_cache()
        return {"loaded": loaded, "version": self.weights_version}, {}

    def packed_modules(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"packed": self.llm.collective_rpc("omnirl_packed_modules")[0]}, {}

    def info(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import vllm

        return {"vllm": vllm.__version__, "pid": os.getpid(), "weights_version": self.weights_version,
                "model": self.model}, {}


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to the server log (a hang's whereabouts)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = server_args()
    server = RolloutServer(str(args["model"]), str(args.get("dtype", "float32")), int(args.get("max_num_seqs", 64)),
                           int(args.get("max_model_len", 4096)), int(args.get("seed", 0)),
                           args.get("gpu_memory_utilization"))
    serve({"generate": server.generate, "load_weights": server.load_weights, "packed_modules": server.packed_modules,
           "info": server.info}, setup=server.start)


if __name__ == "__main__":
    main()
