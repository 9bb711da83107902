"""The trainer-side half of the vLLM rollout engine for autoregressive models: no vllm import here.

vLLM runs in a server process of its own, in the environment ``omnirl env build vllm`` builds
(``omnirl_core.serving.envs``), reached over 127.0.0.1 (``omnirl_core.serving.rollout_server``: safetensors +
JSON, no pickle). This side tokenises each prompt with the model plugin (the same ``TokenPrompt`` the trainer
re-scores), sends the token ids and the sampling distribution (``omnirl_core.ar.rollout``), and turns the
sampled tokens and their log-probs into ``Sample``s. Each request is seeded with its own seed.

Weight sync: before a rollout, when the trained weights changed since the last push (torch's in-place
version counters of the trainable parameters), they go to the engine from tensors, in the checkpoint's names
(``transformers``' reverse of its load-time renaming), through vLLM's in-place reload: with LoRA the adapted
layers with the adapter merged in (base + scale B A) and the layers vLLM fuses them with, or every weight
(``weight_sync: full``, and full fine-tuning). vLLM's prefix cache is reset after a sync.

The model plugin may name the directory vLLM serves (``serving_directory()``: e.g. the Qwen3-Omni thinker saved
alone gets the omni configuration vLLM's model class reads); otherwise its own checkpoint directory.
One server per (environment, directory, engine arguments) per process (``shared_server``).
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

SERVER_MODULE = "omnirl_plugin_vllm.server"


class VllmRolloutOptions(TokenSamplingOptions, ServedEngineOptions):
    max_num_seqs: int = Field(64, ge=1, description="Most sequences vLLM decodes together (continuous batching).")
    max_model_len: int = Field(4096, ge=16, description="Longest prompt + completion vLLM plans its KV cache for.")
    kv_cache_gib: float = Field(4.0, gt=0, description="KV cache size on a CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Share of the GPU's memory vLLM may take "
                                          "(the trainer shares the GPU when colocated).")
    environment: str = Field("vllm", description="The environment vLLM runs in (`omnirl env build NAME`); any "
                             "environment with vLLM 0.30 works, e.g. 'vllm-omni'.")


def serving_directory(model: Any) -> str:
    """The directory (or hub id) vLLM loads: the plugin's ``serving_directory()`` or the module's source."""
    if hasattr(model, "serving_directory"):
        return str(model.serving_directory())
    path = getattr(model.module, "name_or_path", None)
    if not path:
        raise UsageError("The vllm engine loads the model from its checkpoint; this model has no source path.",
                         hint="Load the model from a local directory or hub id (model.path).")
    return str(Path(path).resolve()) if Path(path).is_dir() else str(path)


def _check_cpu_head_size(model: Any) -> None:
    """vLLM's CPU attention takes head sizes of 64 and up: say so before a minutes-long start fails."""
    config = getattr(model.module, "config", None)
    text = getattr(config, "text_config", None) or config
    head = getattr(text, "head_dim", None)
    if head is None and getattr(text, "num_attention_heads", None):
        head = text.hidden_size // text.num_attention_heads
    if head is not None and head < 64:
        raise UsageError(
            f"vLLM's CPU attention takes attention heads of 64 and more; this model's are {head} wide.",
            hint="For the tiny Qwen3-Omni preset add --set model.options.tiny_head_dim=64; or use "
            "rollout.engine=transformers.",
        )


class VllmRolloutEngine(ServedRolloutEngine):
    name = "vllm"
    server_module = SERVER_MODULE
    fallback = "transformers"

    def __init__(self, model: Any, options: VllmRolloutOptions | None, device: Any):
        require_ar_model(model, "vllm")
        options = options or VllmRolloutOptions()
        self.start_served(model, options, device, options.environment)
        self.params = sampling_params(model, self.options)
        self._prompt = PromptCache(model, self.options.prompt_cache_size)
        if self.device_kind == "cpu":
            self.env_vars["VLLM_CPU_KVCACHE_SPACE"] = f"{self.options.kv_cache_gib:g}"
        if self.device_kind == "cpu":
            _check_cpu_head_size(model)
        self.directory = serving_directory(model)
        dtype = str(getattr(model, "dtype", torch.float32)).replace("torch.", "")
        self.args = ["--model", self.directory, "--dtype", dtype, "--max-num-seqs", str(self.options.max_num_seqs),
                     "--max-model-len", str(self.options.max_model_len)]
        if self.device_kind == "cuda":
            self.args += ["--gpu-memory-utilization", str(self.options.gpu_memory_utilization)]
        self._packed: dict[str, list[str]] | None = None
        self.last_stats: dict[str, Any] = {}

    # -- weight sync ---------------------------------------------------------------------------
    def push_weights(self) -> tuple[dict[str, Any], dict[str, float]]:
        state = merged_weights(self.model.module)
        if getattr(self.model, "lora", None) is not None and self.options.weight_sync == "auto":
            layers = self._adapted_layers()
            state = {k: v for k, v in state.items() if k.rsplit(".", 1)[0] in layers}
        state = {k: v.contiguous() for k, v in self._cpu_experts(checkpoint_names(self.model.module, state)).items()}
        meta, _ = self.server.call("load_weights", {}, state, timeout_s=self.options.request_timeout_s)
        return state, {"sync/loaded": float(meta["loaded"])}

    def _cpu_experts(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """vLLM's CPU build repacks MoE expert weights for its kernel, and its in-place reload (0.30) does not
        bring new expert weights into that layout (checked: 0.15 off in log-prob after reloading unchanged
        experts). On a CPU, frozen experts are not sent (the engine holds what it loaded), and trained ones
        are refused; on a GPU every weight goes."""
        if self.device_kind != "cpu" or not any(".experts." in k for k in state):
            return state
        if any(".experts." in name for name, p in self.model.module.named_parameters() if p.requires_grad):
            raise UsageError(
                "The vllm engine cannot take trained MoE expert weights on a CPU: vLLM's CPU build repacks them "
                "for its kernel and does not reload them in place.",
                hint="Train LoRA (the default targets the attention), or use rollout.engine=transformers for full "
                "fine-tuning of a MoE model on a CPU; on a GPU the vllm engine syncs every weight.",
            )
        return {k: v for k, v in state.items() if ".experts." not in k}

    def _adapted_layers(self) -> set[str]:
        """The layers a LoRA adapter changes, with the other members of each layer vLLM fuses them into (its
        ``packed_modules_mapping``: q/k/v, gate/up): vLLM reloads a fused layer from all its parts."""
        if self._packed is None:
            self._packed = self.server.call("packed_modules", timeout_s=self.options.request_timeout_s)[0]["packed"]
        adapted = {name for name, layer in self.model.module.named_modules() if hasattr(layer, "base_layer")}
        out = set(adapted)
        for name in adapted:
            prefix, _, last = name.rpartition(".")
            for members in self._packed.values():
                if last in members:
                    out.update(f"{prefix}.{m}" if prefix else m for m in members)
        return out

    # -- rollout -------------------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Every request through vLLM (its continuous batching); samples in the order of ``requests``."""
        if not requests:
            return
        prompts = [self._prompt(r) for r in requests]
        if any(p.media for p in prompts):
            raise UsageError(
                "The vllm engine takes text prompts only for now: a record has images or audio.",
                hint="Use rollout.engine=transformers for prompts with media (the trainer-side features are not "
                "sent to vLLM, whose own processor would have to expand the placeholders identically).",
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
            raise UsageError("The vllm engine got two requests with the same uid in one call.")
        meta, out = self.server.call("generate", {"requests": fields, "sampling": sampling}, tensors,
                                     timeout_s=self.options.request_timeout_s)
        self.last_stats = meta.get("stats", {})
        for r, prompt in zip(requests, prompts):
            tokens, logprobs = out[f"{r.uid}.tokens"], out[f"{r.uid}.logprobs"]
            if not len(tokens) or not torch.isfinite(logprobs).all():
                raise UsageError(f"The vllm engine returned an empty or non-finite completion for request {r.uid}.")
            yield ar_sample(self.model, r, prompt, tokens, logprobs, self.params)
