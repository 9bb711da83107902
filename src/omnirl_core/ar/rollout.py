"""What every rollout engine of AR models shares: the sampling options a user sets, their translation into the
``SamplingParams`` the trainer re-scores with, the prompt cache and the model check.

An engine (transformers ``generate``, a vLLM server) subclasses ``TokenSamplingOptions`` for its options,
and returns samples through ``ar_sample`` so that every AR sample carries the same extras.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.ar.sampling import SamplingParams, TokenPrompt
from omnirl_core.contracts import GenRequest, PolicyModel, Sample, TokenModel
from omnirl_core.errors import UsageError

if TYPE_CHECKING:
    from omnirl_core.ar.model import CausalLMPolicy


class TokenSamplingOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(256, ge=1, description="Most tokens a completion may have (stop token included).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the trainer re-scores at the same one.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0: off).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set reaching p (1.0: off).")
    allowed_tokens: list[str] | None = Field(
        None, description="Sample only these tokens, each given as text that is exactly one token (guided choice, "
        "e.g. answer letters); the stop tokens stay allowed. None: the whole vocabulary."
    )
    stop_tokens: list[str] | None = Field(
        None, description="Tokens that end a completion; None takes the model's end-of-turn token."
    )
    prompt_cache_size: int = Field(1024, ge=0, description="Tokenised prompts (with media features) kept between "
                                   "steps; prompts do not change during training.")


def require_ar_model(model: PolicyModel, engine: str, calls_model_sampler: bool = False) -> None:
    """The rollout engines of token models drive a transformers causal LM (``CausalLMPolicy``: ``module``,
    ``model_inputs``, ``encode_prompt``, ``token_logprobs``). ``calls_model_sampler``: the engine calls
    ``TokenModel.sample`` for a model that ``samples_itself``; an engine that does not refuses such a model."""
    from omnirl_core.ar.model import CausalLMPolicy

    if not isinstance(model, CausalLMPolicy):
        raise UsageError(
            f"The '{engine}' rollout engine drives autoregressive models; {type(model).__name__} is not an "
            "omnirl_core.ar.model.CausalLMPolicy (it is not an ar-text model).",
            hint="Use the rollout engine the model suggests (e.g. rollout.engine=diffusers for flow models).",
        )
    if model.samples_itself and not calls_model_sampler:
        raise UsageError(
            f"{type(model).__name__} samples its completions itself (TokenModel.sample), which the '{engine}' "
            "rollout engine does not call.",
            hint="Use the rollout engine the model suggests (its README names it).",
        )


def sampling_params(model: CausalLMPolicy, options: TokenSamplingOptions) -> SamplingParams:
    """The distribution the options describe, with the model's token ids."""
    try:
        stop = tuple(model.token_id(t) for t in options.stop_tokens) if options.stop_tokens else model.stop_token_ids
        allowed = None
        if options.allowed_tokens:
            allowed = tuple(dict.fromkeys([model.token_id(t) for t in options.allowed_tokens] + list(stop)))
    except ValueError as exc:
        raise UsageError(f"rollout.options: {exc}.",
                         hint="allowed_tokens / stop_tokens must each be exactly one token of the model's "
                         "tokenizer.") from exc
    return SamplingParams(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                          max_new_tokens=options.max_new_tokens, allowed_token_ids=allowed, stop_token_ids=stop)


class PromptCache:
    """``model.encode_prompt`` per distinct (prompt, inputs), least recently used ones dropped past ``size``."""

    def __init__(self, model: TokenModel, size: int):
        self.model = model
        self.size = size
        self._prompts: OrderedDict[str, TokenPrompt] = OrderedDict()

    def __call__(self, request: GenRequest) -> TokenPrompt:
        key = json.dumps([request.prompt, request.inputs], sort_keys=True, default=str)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return self._prompts[key]
        prompt = self.model.encode_prompt(request)
        if self.size:
            self._prompts[key] = prompt
            while len(self._prompts) > self.size:
                self._prompts.popitem(last=False)
        return prompt


def ar_sample(model: TokenModel, request: GenRequest, prompt: TokenPrompt, tokens: torch.Tensor,
              logprobs: torch.Tensor, params: SamplingParams) -> Sample:
    """The sample of one completion: ``tokens`` / ``logprobs`` as sampled, cut after the first stop token."""
    stop = torch.tensor(params.stop_token_ids, dtype=tokens.dtype)
    stops = torch.isin(tokens, stop).nonzero()
    n = int(stops[0]) + 1 if len(stops) else len(tokens)
    completion = tokens[:n].clone()
    return Sample(
        request=request, latents=None, sigmas=None, logprobs=logprobs[:n].to(torch.float32).clone(),
        output=model.decode(completion),
        prompt_tokens=prompt, completion=completion, sampling=params,
        extras={"truncated": not len(stops)},
    )
