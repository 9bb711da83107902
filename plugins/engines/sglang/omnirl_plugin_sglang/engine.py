"""The trainer-side half of the SGLang rollout engine for autoregressive models: no sglang import here.

SGLang runs in a server process of its own, in the environment ``omnirl env build sglang`` builds
(``omnirl_core.serving.envs``), reached over 127.0.0.1 (``omnirl_core.serving.rollout_server``: safetensors +
JSON, no pickle). This side tokenises each prompt with the model plugin (the same ``TokenPrompt`` the trainer
re-scores), sends the token ids and the sampling distribution (``omnirl_core.ar.rollout``), one request per
sample, and turns the sampled tokens and their log-probs into ``Sample``s. Each request is seeded with its own
seed. SGLang prefills the requests of one batch together, each computing its prompt; with ``share_prefixes``
the server first prefills each prompt several requests share (a GRPO group's) once, so that the group's
samples take it from the radix cache (README, "Prefix sharing").

Weight sync: before a rollout, when the trained weights changed since the last push (torch's in-place version
counters of the trainable parameters), they go to the engine from tensors, in the checkpoint's names
(``transformers``' reverse of its load-time renaming), through SGLang's ``update_weights_from_tensor``: with
LoRA the adapted layers with the adapter merged in (base + scale B A), else (or ``weight_sync: full``) every
weight. SGLang's loader fills fused layers (q/k/v, gate/up) shard by shard, so a layer goes alone. SGLang's
prefix cache is flushed with every sync.

Sampling: SGLang applies top-k and top-p jointly (both cuts measured on the temperature-scaled distribution),
the trainer one after the other (top-p on the top-k-renormalised distribution); the two agree when only one of
them is on, so the engine refuses both together. Guided choice (``allowed_tokens``, the stop tokens kept) is a
logit processor of the server's own inside SGLang (``guided.py``): the log-probs SGLang returns are then those
renormalised over the allowed tokens, as the trainer re-scores them; not with a top-k / top-p cut (refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from omnirl_core.ar.rollout import (
    PromptCache,
    TokenSamplingOptions,
    ar_sample,
    require_ar_model,
    sampling_params,
)
from omnirl_core.contracts import GenRequest, Sample
from omnirl_core.errors import UsageError
from omnirl_core.serving.rollout_server import ServedEngineOptions, ServedRolloutEngine
from omnirl_core.weights import checkpoint_names, merged_weights

SERVER_MODULE = "omnirl_plugin_sglang.server"


class SglangRolloutOptions(TokenSamplingOptions, ServedEngineOptions):
    max_running_requests: int = Field(64, ge=1, description="Most requests SGLang decodes together.")
    context_length: int = Field(4096, ge=16, description="Longest prompt + completion SGLang serves.")
    max_total_tokens: int | None = Field(None, ge=16, description="KV cache size in tokens (None: SGLang sizes it "
                                         "from mem_fraction_static; a CPU default of 16384).")
    mem_fraction_static: float = Field(0.5, gt=0, le=1, description="Share of the GPU's memory SGLang takes for "
                                       "weights and KV cache (the trainer shares the GPU when colocated).")
    share_prefixes: bool = Field(True, description="Prefill each prompt that several samples of a call share "
                                 "(a GRPO group's) once first, one token, so that its samples take it from the radix "
                                 "cache (false: all requests at once, each computing its prompt).")
    environment: str = Field("sglang", description="The environment SGLang runs in (`omnirl env build NAME`).")


def serving_directory(model: Any) -> str:
    """The directory (or hub id) SGLang loads: the plugin's ``serving_directory()`` or the module's source."""
    if hasattr(model, "serving_directory"):
        return str(model.serving_directory())
    path = getattr(model.module, "name_or_path", None)
    if not path:
        raise UsageError("The sglang engine loads the model from its checkpoint; this model has no source path.",
                         hint="Load the model from a local directory or hub id (model.path).")
    return str(Path(path).resolve()) if Path(path).is_dir() else str(path)


def check_sampling(options: TokenSamplingOptions) -> None:
    """What SGLang samples must be what the trainer re-scores."""
    if options.top_k > 0 and options.top_p < 1.0:
        raise UsageError(
            "The sglang engine cannot sample with top_k and top_p together as the trainer re-scores them: SGLang "
            "cuts both on the temperature-scaled distribution, the trainer applies top-p after top-k.",
            hint="Set one of rollout.options.top_k / top_p, or use rollout.engine=vllm or transformers.")
    if options.allowed_tokens and (options.top_k > 0 or options.top_p < 1.0):
        raise UsageError(
            "The sglang engine cannot sample with allowed_tokens and top_k / top_p together: SGLang returns the "
            "log-probs of a cut distribution (its sampling mask) only without a custom logit processor, and guided "
            "choice is one.",
            hint="Unset rollout.options.top_k / top_p with allowed_tokens, or use rollout.engine=vllm or transformers.")


class SglangRolloutEngine(ServedRolloutEngine):
    name = "sglang"
    server_module = SERVER_MODULE
    fallback = "transformers"

    def __init__(self, model: Any, options: SglangRolloutOptions | None, device: Any):
        require_ar_model(model, "sglang")
        options = options or SglangRolloutOptions()
        check_sampling(options)
        self.start_served(model, options, device, options.environment)
        self.params = sampling_params(model, self.options)
        self._prompt = PromptCache(model, self.options.prompt_cache_size)
        self.directory = serving_directory(model)
        dtype = str(getattr(model, "dtype", torch.float32)).replace("torch.", "")
        self.args = ["--model", self.directory, "--device", self.device_kind, "--dtype", dtype,
                     "--context-length", str(self.options.context_length),
                     "--max-running-requests", str(self.options.max_running_requests)]
        if self.options.top_p < 1.0:  # top-p alone goes as top-k over the vocabulary (SGLang's sampling mask)
            self.args += ["--vocab-size", str(model.module.get_output_embeddings().weight.shape[0])]
        total = self.options.max_total_tokens or (16384 if self.device_kind == "cpu" else None)
        if total is not None:
            self.args += ["--max-total-tokens", str(total)]
        if self.device_kind == "cuda":
            self.args += ["--mem-fraction-static", str(self.options.mem_fraction_static)]
        self.last_stats: dict[str, Any] = {}

    # -- weight sync ---------------------------------------------------------------------------
    def push_weights(self) -> tuple[dict[str, Any], dict[str, float]]:
        state = merged_weights(self.model.module)
        if getattr(self.model, "lora", None) is not None and self.options.weight_sync == "auto":
            adapted = {name for name, layer in self.model.module.named_modules() if hasattr(layer, "base_layer")}
            state = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] in adapted}
        state = {k: v.contiguous() for k, v in checkpoint_names(self.model.module, state).items()}
        meta, _ = self.server.call("load_weights", {}, state, timeout_s=self.options.request_timeout_s)
        return state, {"sync/loaded": float(meta["loaded"])}

    # -- rollout -------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Every request through SGLang (continuous batching, prefix sharing); samples in request order."""
        if not requests:
            return
        prompts = [self._prompt(r) for r in requests]
        if any(p.media for p in prompts):
            raise UsageError(
                "The sglang engine takes text prompts only for now: a record has images or audio.",
                hint="Use rollout.engine=transformers for prompts with media (the trainer-side features are not "
                "sent to SGLang, whose own processor would have to expand the placeholders identically).",
            )
        self.sync_weights()
        p = self.params
        sampling = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                    "max_new_tokens": p.max_new_tokens, "stop_token_ids": list(p.stop_token_ids),
                    "allowed_token_ids": list(p.allowed_token_ids) if p.allowed_token_ids is not None else None}
        fields = [{"uid": r.uid, "seed": int(r.seed)} for r in requests]
        tensors = {f"{r.uid}.prompt_ids": prompt.input_ids.to(torch.long).clone()  # cached prompts repeat
                   for r, prompt in zip(requests, prompts)}
        if len(tensors) != len(requests):
            raise UsageError("The sglang engine got two requests with the same uid in one call.")
        meta, out = self.server.call("generate", {"requests": fields, "sampling": sampling,
                                                  "share_prefixes": self.options.share_prefixes}, tensors,
                                     timeout_s=self.options.request_timeout_s)
        self.last_stats = meta.get("stats", {})
        for r, prompt in zip(requests, prompts):
            tokens, logprobs = out[f"{r.uid}.tokens"], out[f"{r.uid}.logprobs"]
            if not len(tokens) or not torch.isfinite(logprobs).all():
                raise UsageError(f"The sglang engine returned an empty or non-finite completion for request {r.uid}.")
            yield ar_sample(self.model, r, prompt, tokens, logprobs, self.params)
