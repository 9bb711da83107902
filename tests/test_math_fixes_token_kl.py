"""The token KL of GSPO / GRPO when a sampled token leaves the current policy's top-k after an optimizer step
(issue 30, learning math): the KL term's policy side is evaluated without the top-k / top-p cut, like its
reference side, so loss and gradient stay finite; the importance ratio still uses the sampling distribution.

A tiny random-weight causal LM (transformers' Llama, 1 layer) under ``CausalLMPolicy`` stands in for an AR model
plugin; "an optimizer step" is an edit of the output embedding that drops one sampled token out of the top-k."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from omnirl_plugin_gspo.algorithm import GRPO, GSPO, GRPOConfig, GSPOConfig

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.ar.policy_gradient import masked_mean, padded
from omnirl_core.ar.sampling import SamplingParams, TokenPrompt
from omnirl_core.config import LoraConfig, RunConfig
from omnirl_core.contracts import Sample
from omnirl_core.loop.training import MetricMean, prepare_all

TOP_K = 3
PARAMS = SamplingParams(temperature=0.8, top_k=TOP_K, max_new_tokens=4)
UNCUT = dataclasses.replace(PARAMS, top_k=0, top_p=1.0)


class _TinyLM(CausalLMPolicy):
    """The AR base class around a 1-layer Llama with a 32-token vocabulary; prompts are given as ids."""

    def media_inputs(self, media):
        return {}


def _model() -> _TinyLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    module = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    model = _TinyLM(module, SimpleNamespace(pad_token_id=0, eos_token_id=1), torch.device("cpu"), torch.float32)
    model.setup_training(LoraConfig(enabled=False), need_reference=True)  # full fine-tuning, a frozen reference
    return model


def _hidden(model: _TinyLM, prompt: TokenPrompt, tokens: list[int]) -> torch.Tensor:
    """The last hidden state after prompt + tokens: what predicts the next token."""
    seq = torch.cat([prompt.input_ids, torch.tensor(tokens, dtype=torch.long)])
    return model.hidden_states(model.model_inputs([seq], [{}], side="right"))[0, -1]


def _samples(model: _TinyLM) -> list[Sample]:
    """Two completions of 4 tokens, each token the least likely one inside the top-k (a legal draw), with the
    log-probs the rollout recorded."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(2):
        prompt = TokenPrompt(input_ids=torch.randint(2, 32, (5,), generator=g))
        tokens: list[int] = []
        with torch.no_grad():
            for _ in range(PARAMS.max_new_tokens):
                logits = model.module.get_output_embeddings()(_hidden(model, prompt, tokens))
                tokens.append(int(torch.topk(logits, TOP_K).indices[-1]))
            completion = torch.tensor(tokens)
            [logprobs] = model.token_logprobs([prompt], [completion], [PARAMS])
        assert torch.isfinite(logprobs).all()
        samples.append(Sample(request=SimpleNamespace(group=0), latents=None, sigmas=None, logprobs=logprobs,
                              output="", advantage=1.0 if i == 0 else -1.0,
                              prompt_tokens=prompt, completion=completion, sampling=PARAMS))
    return samples


def _drop_out_of_top_k(model: _TinyLM, sample: Sample, position: int) -> None:
    """Set the output embedding of the token sampled at ``position`` so that its logit there lies 0.5 below the
    (k+1)-th largest: just outside the top-k of the current policy, as a small step can leave it."""
    prompt, completion = sample.prompt_tokens, sample.completion
    token = int(completion[position])
    head = model.module.get_output_embeddings()
    with torch.no_grad():
        h = _hidden(model, prompt, completion[:position].tolist())
        target = float(torch.sort(head(h), descending=True).values[TOP_K]) - 0.5
        head.weight[token] = target * h / (h @ h)
        [cut] = model.token_logprobs([prompt], [completion], [PARAMS])
    assert math.isinf(float(cut[position])), "the edit must take the token out of the top-k"


def _k3(ref: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> float:
    diff = ref - logp
    return float(masked_mean(torch.exp(diff) - diff - 1.0, mask).mean())


@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_kl_stays_finite_when_a_sampled_token_leaves_the_top_k(name: str):
    model = _model()
    samples = _samples(model)
    algo = GSPO(GSPOConfig(beta=0.1), RunConfig()) if name == "gspo" else GRPO(GRPOConfig(beta=0.1), RunConfig())
    units = algo.training_units(samples)
    prepare_all(algo, model, units, 8, MetricMean())  # old log-probs (recompute), the reference's (uncut)
    _drop_out_of_top_k(model, samples[0], position=2)  # what an optimizer step can do between minibatches

    loss, metrics = algo.loss(model, units)
    assert math.isfinite(float(loss)), f"loss {float(loss)} (before the fix: NaN from exp(inf) - inf)"
    loss.backward()
    grads = [p.grad for p in model.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)

    prompts = [s.prompt_tokens for s in samples]
    completions = [s.completion for s in samples]
    with torch.no_grad():
        uncut, mask = padded(model.token_logprobs(prompts, completions, [UNCUT] * 2), "cpu")
        cut, _ = padded(model.token_logprobs(prompts, completions, [PARAMS] * 2), "cpu")
    ref, _ = padded([u.ref_logprobs for u in units], "cpu")
    # the KL term: k3 between the uncut policy and the uncut reference, finite and > 0 (the weights moved)
    assert metrics["kl"] == pytest.approx(_k3(ref, uncut, mask), rel=1e-5)
    assert 0 < metrics["kl"] < 10
    # the ratio: the sampling (cut) distribution, where the dropped token has probability 0
    assert math.isinf(float(cut[0, 2]))
    old, _ = padded([u.old_logprobs for u in units], "cpu")
    per_seq, _ = algo.surrogate(cut, old, mask, torch.tensor([1.0, -1.0]))
    assert metrics["policy_loss"] == pytest.approx(float(per_seq.mean()), rel=1e-5, abs=1e-7)
    assert float(loss) == pytest.approx(metrics["policy_loss"] + 0.1 * metrics["kl"], rel=1e-5)


def test_the_policy_is_scored_once_for_the_ratio_and_the_kl():
    """The cut (ratio) and uncut (KL) log-probs come from one forward pass of the policy, equal to what two
    separate calls give."""
    model = _model()
    samples = _samples(model)
    algo = GSPO(GSPOConfig(beta=0.1), RunConfig())
    units = algo.training_units(samples)
    prepare_all(algo, model, units, 8, MetricMean())
    calls = []
    forward = model.hidden_states
    model.hidden_states = lambda inputs: calls.append(1) or forward(inputs)
    algo.loss(model, units)
    assert len(calls) == 1
    prompts = [s.prompt_tokens for s in samples]
    completions = [s.completion for s in samples]
    with torch.no_grad():
        cut, uncut = model.token_logprobs_under(prompts, completions, [[PARAMS] * 2, [UNCUT] * 2])
        for a, b in zip(cut, model.token_logprobs(prompts, completions, [PARAMS] * 2)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(uncut, model.token_logprobs(prompts, completions, [UNCUT] * 2)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
