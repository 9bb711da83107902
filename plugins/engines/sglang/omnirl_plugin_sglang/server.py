"""The SGLang rollout server: ``python -m omnirl_plugin_sglang.server --model DIR [--device cpu] [--dtype float32]
[--context-length 4096] [--max-running-requests 64] [--max-total-tokens 16384] [--seed 0]
[--mem-fraction-static 0.5]``, run by the engine in the SGLang environment (see ``engine.py``).

Calls (``omnirl_core.serving.rollout_server``): ``generate`` (prompt token ids + sampling settings per request
-> the sampled tokens and the log-prob of each under the distribution it was drawn from, and the prompt tokens
SGLang took from its prefix cache), ``load_weights`` (weights in the checkpoint's names, through SGLang's
``update_weights_from_tensor``), ``info``.

SGLang runs in this process as its offline ``sglang.Engine`` (its scheduler and detokenizer are child
processes); requests are SGLang's own ``GenerateReqInput``, one request per sample: a group's shared prompt
is found in the radix cache (RadixAttention) by requests scheduled after it was computed. The requests of one
batch are prefilled together, each computing its prompt; with ``share_prefixes`` (the call's meta) a first
batch prefills each prompt that several requests share, one greedy token whose draw is discarded, and the
samples then compute only their prompt's last token (SGLang recomputes it for the logits).

Guided choice (``allowed_tokens``): a custom logit processor of this plugin's (``guided.py``), built here and
never taken from a client; SGLang applies it before the temperature and its log-probs.

Log-probs: with top-k or top-p, SGLang's sampling-mask output (``return_sampling_mask``), the log-prob of each
sampled token under the support SGLang sampled from, renormalised; without a cut, its ``output_token_logprobs``
(log-softmax at the temperature). Either is what the trainer re-scores (``omnirl_core.ar.sampling.sampling_logprobs``). Per-request seeds are SGLang's ``sampling_seed``,
which it honours only with deterministic inference on: on a GPU; SGLang refuses deterministic inference with its
CPU attention (torch_native), so on a CPU requests draw from the server's one random stream.

A Qwen3-Omni thinker saved alone (the tiny preset, a thinker fine-tuned and saved by omnirl) has its weights
without the ``thinker.`` prefix SGLang's Qwen3-Omni class loads, and a thinker configuration without
``vision_end_token_id``, which SGLang's Qwen-VL processor reads: the server serves it from a directory beside
it with that key added, loads the weights under the prefix once SGLang has started, and prefixes every synced
weight the same way.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omnirl_core.serving.rollout_server import serve, server_args

THINKER_PREFIX = "thinker."
VISION_END_TOKEN = "<|vision_end|>"


def use_cpu_shim() -> bool:
    """On a CPU without SGLang's CPU kernel library (``sgl_kernel`` built for CPU), put the import-only
    stand-in (``cpu_shim/sgl_kernel``) on the path; spawned children (scheduler, detokenizer) inherit it."""
    try:
        import sgl_kernel  # noqa: F401
        return False
    except ImportError:
        pass
    sys.path.insert(0, str(Path(__file__).with_name("cpu_shim")))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (sys.path[0], os.environ.get("PYTHONPATH")) if p)
    return True


def _weight_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def serving_directory(model: str) -> tuple[str, str]:
    """The directory SGLang loads and the prefix weights take there ('' or ``thinker.``)."""
    directory = Path(model)
    config_path = directory / "config.json"
    if not config_path.is_file():
        return model, ""
    config = json.loads(config_path.read_text())
    thinker = config.get("thinker_config")
    if thinker is None:
        return model, ""
    prefix = "" if any(n.startswith(THINKER_PREFIX) for n in _weight_names(directory)) else THINKER_PREFIX
    if "vision_end_token_id" in thinker:
        return model, prefix
    vocab = json.loads((directory / "tokenizer.json").read_text()).get("added_tokens", []) \
        if (directory / "tokenizer.json").is_file() else []
    ids = [t["id"] for t in vocab if t.get("content") == VISION_END_TOKEN]
    thinker["vision_end_token_id"] = ids[0] if ids else thinker.get("vision_start_token_id", 0) + 1
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + str(directory.resolve()).encode())
    out = Path(tempfile.gettempdir()) / f"omnirl-sglang-{key.hexdigest()[:12]}"
    out.mkdir(exist_ok=True)
    for item in directory.iterdir():
        link = out / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return str(out), prefix


class RolloutServer:
    def __init__(self, model: str, device: str = "cuda", dtype: str = "float32", context_length: int = 4096,
                 max_running_requests: int = 64, max_total_tokens: int | None = None, seed: int = 0,
                 mem_fraction_static: float | None = None, vocab_size: int = 0):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.seed = seed
        self.mem_fraction_static = mem_fraction_static
        self.vocab_size = vocab_size
        self.engine: Any = None
        self.prefix = ""
        self.shim = False
        self.weights_version = 0

    def start(self) -> None:
        if self.device == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            self.shim = use_cpu_shim()
        import sglang

        directory, self.prefix = serving_directory(self.model)
        kwargs: dict[str, Any] = {}
        if self.max_total_tokens is not None:
            kwargs["max_total_tokens"] = self.max_total_tokens
        if self.vocab_size:  # top-p alone is sampled as top-k over the whole vocabulary (see sampling_params)
            kwargs["sampling_mask_max_tokens"] = self.vocab_size
        if self.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = self.mem_fraction_static
        if self.device == "cpu":
            # SGLang refuses deterministic inference with torch_native attention (its CPU attention): no
            # per-request seeds on a CPU, the server's random_seed only
            kwargs.update(attention_backend="torch_native", disable_cuda_graph=True)
        else:
            kwargs.update(enable_deterministic_inference=True)
        # token ids in, token ids out (the trainer tokenises); the pytorch sampling backend honours per-request
        # seeds (sampling_seed), which SGLang applies with deterministic inference on
        self.engine = sglang.Engine(
            model_path=directory, device=self.device, dtype=self.dtype, context_length=self.context_length,
            max_running_requests=self.max_running_requests, sampling_backend="pytorch", random_seed=self.seed,
            skip_tokenizer_init=True, skip_server_warmup=True, log_level="warning",
            # guided choice: the server's own processor (guided.py); SGLang's HTTP server, which would take
            # processors from clients, is not started
            enable_custom_logit_processor=True, **kwargs)
        if self.prefix:  # the checkpoint's own weights under the names SGLang's model class loads
            from safetensors.torch import load_file

            for path in sorted(Path(self.model).glob("*.safetensors")):
                self._update(load_file(str(path)))

    def _update(self, tensors: dict[str, torch.Tensor]) -> None:
        """One SGLang weight-update session (begin / update from tensors / end, which puts quantised weights
        back into their kernel layout); the update flushes the prefix cache."""
        named = [(self.prefix + name, tensor) for name, tensor in tensors.items()]
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            _check(self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True),
                   "update_weights_from_tensor")
        finally:
            _check(self.engine.end_weight_update(), "end_weight_update")

    def _run(self, obj: Any) -> list[dict[str, Any]]:
        """One batch of SGLang requests (a ``GenerateReqInput``) to completion: SGLang's outputs in order."""
        return self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.generate_request(obj, None).__anext__())

    def generate(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        s = meta["sampling"]
        requests = meta["requests"]
        prompts = [tensors[f"{r['uid']}.prompt_ids"].tolist() for r in requests]
        stats = {"seconds": 0.0, "requests": len(requests), "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0,
                 "shared_prompts": 0, "prefill_tokens": 0}
        start = time.perf_counter()
        shared = shared_prompts(prompts) if meta.get("share_prefixes") else []
        if shared:
            # one request per repeated prompt first, one token each (its draw is discarded): its prompt is then in
            # the radix cache, and each sample of the group computes only its prompt's last token
            warm = self._run(GenerateReqInput(
                input_ids=shared, sampling_params=[dict(WARM) for _ in shared],
                rid=[f"omnirl-{time.monotonic_ns()}-warm-{i}" for i in range(len(shared))]))
            stats["shared_prompts"] = len(shared)
            stats["prefill_tokens"] += sum(_computed(o["meta_info"]) for o in warm)
        guided: dict[str, Any] = {}
        if s.get("allowed_token_ids"):
            from omnirl_plugin_sglang.guided import processor

            guided = {"custom_logit_processor": [processor()] * len(requests)}
        outputs = self._run(GenerateReqInput(
            input_ids=prompts, sampling_params=[sampling_params(s, int(r["seed"]), self.vocab_size) for r in requests],
            rid=[f"omnirl-{time.monotonic_ns()}-{r['uid']}" for r in requests],
            return_logprob=True, return_sampling_mask=cut(s), **guided))
        stats["seconds"] = time.perf_counter() - start
        out: dict[str, Any] = {}
        for r, output in zip(requests, outputs):
            tokens, logprobs = parse_output(output, cut(s))
            out[f"{r['uid']}.tokens"] = torch.tensor(tokens, dtype=torch.long)
            out[f"{r['uid']}.logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
            info = output["meta_info"]
            stats["tokens"] += len(tokens)
            stats["prompt_tokens"] += int(info.get("prompt_tokens", 0))
            stats["cached_tokens"] += int(info.get("cached_tokens", 0) or 0)
            stats["prefill_tokens"] += _computed(info)
        return {"stats": stats}, out

    def load_weights(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        self._update(tensors)  # flush_cache: cached prefixes were computed with the old weights
        self.weights_version += 1
        return {"loaded": len(tensors), "version": self.weights_version}, {}

    def flush_cache(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"flushed": bool(getattr(self.engine.flush_cache(), "success", True))}, {}

    def info(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import sglang

        return {"sglang": sglang.__version__, "pid": os.getpid(), "weights_version": self.weights_version,
                "model": self.model, "prefix": self.prefix, "cpu_shim": self.shim}, {}


def _check(result: Any, what: str) -> None:
    """SGLang's control calls answer (success, message) or an object with ``success`` / ``message``."""
    if isinstance(result, tuple):
        ok, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    else:
        ok, message = bool(getattr(result, "success", True)), str(getattr(result, "message", ""))
    if not ok:
        raise RuntimeError(f"SGLang's {what} failed: {message}")


# the request that puts a shared prompt into the radix cache: one greedy token (no random draw), discarded
WARM = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False}


def shared_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The prompts that occur more than once in a call (a GRPO group's), each once, in order of first use."""
    counts: dict[tuple[int, ...], int] = {}
    for p in prompts:
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    return [list(p) for p, n in counts.items() if n > 1]


def _computed(info: dict[str, Any]) -> int:
    """Prompt tokens SGLang computed for one request (those not taken from its radix cache)."""
    return int(info.get("prompt_tokens", 0)) - int(info.get("cached_tokens", 0) or 0)


def cut(s: dict[str, Any]) -> bool:
    """Whether the distribution is cut (top-k or top-p): then the log-probs come from SGLang's sampling mask."""
    return int(s["top_k"]) > 0 or float(s["top_p"]) < 1.0


def sampling_params(s: dict[str, Any], seed: int, vocab_size: int = 0) -> dict[str, Any]:
    """SGLang's sampling parameters of one request (its ``SamplingParams`` fields): the stop tokens are ours
    alone (``ignore_eos``), top-k off is -1 there, no penalty or min-p changes the distribution. SGLang's
    sampling mask takes a finite top-k only: top-p alone is sent with top-k = the vocabulary (no cut)."""
    top_k = int(s["top_k"]) if s["top_k"] > 0 else (vocab_size if float(s["top_p"]) < 1.0 and vocab_size else -1)
    params = {"temperature": float(s["temperature"]), "top_k": top_k,
              "top_p": float(s["top_p"]), "min_p": 0.0, "max_new_tokens": int(s["max_new_tokens"]),
              "stop_token_ids": list(s["stop_token_ids"]), "ignore_eos": True, "skip_special_tokens": False,
              "sampling_seed": seed, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    if s.get("allowed_token_ids"):  # guided choice: the parameter of the server's logit processor (guided.py)
        params["custom_params"] = {"allowed_token_ids": [int(t) for t in s["allowed_token_ids"]]}
    return params


def parse_output(output: dict[str, Any], cut: bool) -> tuple[list[int], list[float]]:
    """The sampled tokens of one SGLang response and their log-probs: uncut, SGLang's ``output_token_logprobs``
    (log-softmax at the temperature: ``(logprob, token id, text)`` per token); cut by top-k / top-p, its
    sampling-mask ``output_token_sampling_logprobs`` (renormalised over the support it sampled from; the
    former are before the cut)."""
    tokens = [int(t) for t in output["output_ids"]]
    info = output["meta_info"]
    if cut:
        logprobs = info.get("output_token_sampling_logprobs")
    else:
        logprobs = [entry[0] for entry in info.get("output_token_logprobs") or []]
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(f"SGLang returned {len(logprobs or [])} sampling log-probs for {len(tokens)} tokens "
                           f"(request {info.get('id')})")
    return tokens, [float(x) for x in logprobs]


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to the server log (a hang's whereabouts)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = server_args()
    server = RolloutServer(str(args["model"]), str(args.get("device", "cuda")), str(args.get("dtype", "float32")),
                           int(args.get("context_length", 4096)), int(args.get("max_running_requests", 64)),
                           args.get("max_total_tokens"), int(args.get("seed", 0)), args.get("mem_fraction_static"),
                           int(args.get("vocab_size", 0)))
    serve({"generate": server.generate, "load_weights": server.load_weights, "flush_cache": server.flush_cache,
           "info": server.info}, setup=server.start)


if __name__ == "__main__":
    main()
