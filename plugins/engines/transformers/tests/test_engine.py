"""The transformers rollout engine on a tiny text policy (the core's ``CausalLMPolicy`` over a random 2-layer
Qwen2 causal LM and the small built-in BPE tokenizer; no model plugin): the sampled tokens and log-probs are
what the trainer re-scores, a request samples the same alone or in a batch, and a checkpoint's generation
defaults never change the sampled distribution."""

from __future__ import annotations

import pytest
import torch
from omnirl_plugin_transformers.engine import TransformersRolloutEngine, TransformersRolloutOptions

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.ar.policy_gradient import AR_PLAN
from omnirl_core.ar.sampling import TokenPrompt
from omnirl_core.contracts import GenRequest
from omnirl_core.presets import small_bpe_tokenizer

PROMPTS = ["a red square", "the cat on a chair", "what is 2", "hello world"]


class TextPolicy(CausalLMPolicy):
    """Text only: the prompt's tokens, no chat template, no media."""

    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        ids = self.tokenizer(request.prompt, return_tensors="pt").input_ids[0]
        return TokenPrompt(ids, {})

    def media_inputs(self, media):
        return {}


@pytest.fixture(scope="module")
def model() -> TextPolicy:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = small_bpe_tokenizer()
    torch.manual_seed(0)
    module = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.pad_token_id,
    )).eval()
    return TextPolicy(module, tokenizer, torch.device("cpu"), torch.float32)


def _requests(group_size: int = 2) -> list[GenRequest]:
    return [GenRequest(uid=p * group_size + g, prompt=text, prompt_index=p, group=p, seed=1000 + p * group_size + g,
                       height=0, width=0, plan=AR_PLAN)
            for p, text in enumerate(PROMPTS) for g in range(group_size)]


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 50, "top_p": 0.9}])
def test_sampled_logprobs_are_what_the_trainer_rescores(model, sampling: dict):
    samples = list(TransformersRolloutEngine(model, TransformersRolloutOptions(max_new_tokens=6, **sampling), "cpu")
                   .generate(_requests()))
    assert len(samples) == 8 and all(torch.isfinite(s.logprobs).all() for s in samples)
    with torch.no_grad():
        rescored = model.token_logprobs([s.prompt_tokens for s in samples][::-1],
                                        [s.completion for s in samples][::-1],
                                        [s.sampling for s in samples][::-1])[::-1]
    assert max(float((a - s.logprobs).abs().max()) for a, s in zip(rescored, samples)) < 1e-5


def test_a_request_samples_the_same_tokens_alone_or_in_a_batch(model):
    engine = TransformersRolloutEngine(model, TransformersRolloutOptions(max_new_tokens=5), "cpu")
    batch = list(engine.generate(_requests(group_size=3)))
    [alone] = engine.generate([_requests(group_size=3)[4]])
    assert torch.equal(batch[4].completion, alone.completion)
    torch.testing.assert_close(batch[4].logprobs, alone.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(s.completion.tolist()) for s in batch}) > 1  # seeds differ per request


def test_checkpoint_generation_defaults_do_not_leak_into_sampling(model):
    """A checkpoint's generation_config (here a repetition penalty) must not change the sampled distribution."""
    saved = model.module.generation_config.repetition_penalty
    model.module.generation_config.repetition_penalty = 3.0
    try:
        samples = list(TransformersRolloutEngine(model, TransformersRolloutOptions(max_new_tokens=6), "cpu")
                       .generate(_requests()))
        rescored = model.token_logprobs([s.prompt_tokens for s in samples],
                                        [s.completion for s in samples],
                                        [s.sampling for s in samples])
        assert max(float((a.detach() - s.logprobs).abs().max()) for a, s in zip(rescored, samples)) < 1e-5
        assert model.module.generation_config.repetition_penalty == 3.0  # restored
    finally:
        model.module.generation_config.repetition_penalty = saved


@pytest.mark.parametrize("max_batch_size", [32, 2])
def test_the_rollout_engine_contract_suite(model, max_batch_size: int):
    """The core's rollout-engine suite, token variant: samples, token trajectories, seeds and the re-scoring."""
    from omnirl_core.testing.engines import check_rollout_engine

    samples = check_rollout_engine(lambda m: TransformersRolloutEngine(
        m, TransformersRolloutOptions(max_new_tokens=6, max_batch_size=max_batch_size), "cpu"), model=model)
    assert len(samples) == 6 and all(s.completion.numel() >= 1 for s in samples)


def test_the_rollout_engine_contract_suite_on_tiny_qwen3_omni(tmp_path):
    """The same suite on a real omni model's thinker (the tiny Qwen3-Omni preset: MoE, the real Qwen tokenizer and
    chat template), when its plugin is installed."""
    from omnirl_core.config import LoraConfig, ModelSection
    from omnirl_core.errors import PluginError
    from omnirl_core.plugins import get_plugin_manager
    from omnirl_core.testing.engines import check_rollout_engine

    try:  # the installed plugin, by name (plugins never import each other)
        spec = get_plugin_manager().resolve("model", "qwen3-omni")
    except PluginError:
        pytest.skip("the qwen3-omni model plugin is not installed")
    omni = spec.load_factory()(ModelSection(name="qwen3-omni", preset="tiny"), spec.load_config()(), "cpu")
    omni.setup_training(LoraConfig(rank=4, alpha=8), need_reference=False)
    samples = check_rollout_engine(lambda m: TransformersRolloutEngine(
        m, TransformersRolloutOptions(max_new_tokens=6, max_batch_size=4), "cpu"), model=omni)
    assert all(s.prompt_tokens.input_ids.numel() > len(s.request.prompt.split()) for s in samples)  # the template
