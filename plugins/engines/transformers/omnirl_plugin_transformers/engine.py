"""Rollout for AR models through transformers ``generate``, recording per-token log-probs.

Sampling happens inside a logits processor: it turns the step's logits into the sampling distribution with
the core's ``sampling_logprobs`` (the same function the trainer re-scores with), draws each row's token with
that request's own seeded generator, records the token's log-prob, and hands ``generate`` (run greedy) a
distribution concentrated on the drawn token. So the recorded log-prob is exactly that of the distribution
sampled, a request's tokens do not depend on its batch-mates, and ``generate`` still owns the KV cache,
multimodal prefill, padding and stopping.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import LogitsProcessor

from omnirl_core.ar.sampling import SamplingParams, TokenPrompt, sample_tokens, sampling_logprobs
from omnirl_core.errors import UsageError
from omnirl_core.interfaces import GenRequest, Sample


class TransformersRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch_size: int = Field(32, ge=1, description="Requests per generate call (left-padded together).")
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


class _SampleAndRecord(LogitsProcessor):
    """A transformers logits processor that samples (see the module docstring) and records (token, logp)."""

    def __init__(self, params: SamplingParams, generators: list[torch.Generator]):
        self.params = params
        self.generators = generators
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = sampling_logprobs(scores, self.params)
        tokens = sample_tokens(logp, self.generators)
        self.tokens.append(tokens.cpu())
        self.logprobs.append(logp.gather(-1, tokens[:, None])[:, 0].cpu())
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, tokens[:, None], 0.0)


@contextmanager
def _plain_generation_defaults(module: Any) -> Iterator[None]:
    """A checkpoint's ``generation_config.json`` fills every generate setting left unset (repetition penalty,
    suppressed tokens, ...): any such processor would change the logits behind our back. Run with none."""
    from transformers import GenerationConfig

    saved = module.generation_config
    module.generation_config = GenerationConfig()
    try:
        yield
    finally:
        module.generation_config = saved


class TransformersRolloutEngine:
    def __init__(self, model: Any, options: TransformersRolloutOptions | None, device: Any):
        for needed in ("encode_prompt", "model_inputs", "token_logprobs", "module"):
            if not hasattr(model, needed):
                raise UsageError(
                    f"The 'transformers' rollout engine drives autoregressive models; {type(model).__name__} has no "
                    f"'{needed}' (it is not an ar-text model).",
                    hint="Use the rollout engine the model suggests (e.g. rollout.engine=diffusers for flow models).",
                )
        self.model = model
        self.options = options or TransformersRolloutOptions()
        self.device = torch.device(device)
        self.params = self._sampling_params()
        self._prompts: OrderedDict[str, TokenPrompt] = OrderedDict()

    def _sampling_params(self) -> SamplingParams:
        o = self.options
        try:
            stop = tuple(self.model.token_id(t) for t in o.stop_tokens) if o.stop_tokens else \
                self.model.stop_token_ids
            allowed = None
            if o.allowed_tokens:
                allowed = tuple(dict.fromkeys([self.model.token_id(t) for t in o.allowed_tokens] + list(stop)))
        except ValueError as exc:
            raise UsageError(f"rollout.options: {exc}.",
                             hint="allowed_tokens / stop_tokens must each be exactly one token of the model's "
                             "tokenizer.") from exc
        return SamplingParams(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                              max_new_tokens=o.max_new_tokens, allowed_token_ids=allowed, stop_token_ids=stop)

    def _prompt(self, request: GenRequest) -> TokenPrompt:
        key = json.dumps([request.prompt, request.inputs], sort_keys=True, default=str)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return self._prompts[key]
        prompt = self.model.encode_prompt(request)
        if self.options.prompt_cache_size:
            self._prompts[key] = prompt
            while len(self._prompts) > self.options.prompt_cache_size:
                self._prompts.popitem(last=False)
        return prompt

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        size = self.options.max_batch_size
        for start in range(0, len(requests), size):
            yield from self._generate(requests[start:start + size])

    @torch.no_grad()
    def _generate(self, batch: list[GenRequest]) -> Iterator[Sample]:
        from transformers import GenerationConfig, LogitsProcessorList

        prompts = [self._prompt(r) for r in batch]
        inputs = self.model.model_inputs([p.input_ids for p in prompts], [p.media for p in prompts], side="left")
        recorder = _SampleAndRecord(self.params, [torch.Generator().manual_seed(r.seed) for r in batch])
        config = GenerationConfig(
            do_sample=False, max_new_tokens=self.params.max_new_tokens,
            eos_token_id=list(self.params.stop_token_ids), pad_token_id=self.model.pad_token_id,
        )
        module = self.model.module
        with _plain_generation_defaults(module):
            out = module.generate(**inputs, generation_config=config,
                                  logits_processor=LogitsProcessorList([recorder]))
        tokens = torch.stack(recorder.tokens, dim=1)
        logprobs = torch.stack(recorder.logprobs, dim=1)
        generated = out[:, inputs["input_ids"].shape[1]:].cpu()
        stop = torch.tensor(self.params.stop_token_ids)
        for b, (request, prompt) in enumerate(zip(batch, prompts)):
            stops = torch.isin(tokens[b], stop).nonzero()
            n = int(stops[0]) + 1 if len(stops) else tokens.shape[1]
            completion = tokens[b, :n].clone()
            if not torch.equal(generated[b, :n], completion):
                raise RuntimeError("generate did not emit the sampled tokens: another logits processor or a "
                                   "forced token interfered with sampling")
            yield Sample(
                request=request, latents=None, sigmas=None, logprobs=logprobs[b, :n].clone(),
                output=self.model.decode(completion),
                extras={"prompt": prompt, "completion": completion, "sampling": self.params,
                        "truncated": not len(stops)},
            )
