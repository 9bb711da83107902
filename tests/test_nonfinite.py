"""Numbers that must never reach the weights: a NaN/inf loss or gradient is caught before the optimizer step
(the weights stay as they were); the token KL stays finite when a sampled token lies outside the reference's
top-k; a stochastic sampler refuses a zero noise level."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnirl_core.algorithm import Algorithm
from omnirl_core.ar.policy_gradient import SequenceUnit, TokenPolicyGradient
from omnirl_core.ar.sampling import SamplingParams, sampling_logprobs
from omnirl_core.config import RunConfig
from omnirl_core.contracts import Sample, TrainingUnit
from omnirl_core.flow.sampler import step_mean, transition_logprob
from omnirl_core.loop.training import NonFiniteError


class _Linear:
    """A model with one trainable weight (what the torch engine needs of a model)."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.ones(3))

    def trainable_parameters(self):
        return [self.weight]


class _Unit(TrainingUnit):
    sample = None  # a unit of no single sample: its own minibatch block


class _Algorithm(Algorithm):
    """Loss = sum(w * x) with a chosen x; x holding NaN makes a NaN loss and NaN gradients."""

    def __init__(self, bad_minibatch: int | None):
        super().__init__(None, RunConfig())
        self.bad_minibatch = bad_minibatch
        self.calls = 0

    def loss(self, model, units, first_update=False, correction=False):
        x = torch.full((3,), float("nan")) if self.calls == self.bad_minibatch else torch.ones(3)
        self.calls += 1
        return (model.weight * x).sum(), {}


def _engine(policy: str):
    from omnirl_plugin_torch.engine import TorchTrainEngine

    train = RunConfig().train.model_copy(update={"minibatches": 2, "micro_batch_size": 8, "nonfinite": policy})
    model = _Linear()
    return TorchTrainEngine(model, train, None, "cpu"), model


def test_a_nan_loss_stops_before_the_optimizer_step_and_names_the_way_out():
    engine, model = _engine("stop")
    with pytest.raises(NonFiniteError, match="minibatch 1: grad_norm=nan") as err:
        engine.update(_Algorithm(bad_minibatch=0), [_Unit(), _Unit()], step=7)
    assert "train.nonfinite=skip" in err.value.render() and "step 7" in err.value.render()
    assert torch.equal(model.weight.detach(), torch.ones(3))  # untouched
    assert not engine.optimizer.state  # no AdamW step was taken


def test_skip_mode_drops_the_bad_minibatch_and_counts_it():
    engine, model = _engine("skip")
    metrics = engine.update(_Algorithm(bad_minibatch=1), [_Unit(), _Unit()], step=1)
    assert metrics["train/skipped_minibatches"] == 0.5  # 1 of 2 minibatches
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight.detach(), torch.ones(3))
    assert int(engine.optimizer.state[model.weight]["step"]) == 1


class _TokenModel:
    """Fixed logits over a 4-token vocabulary: token 2 is outside the top-2."""

    device = torch.device("cpu")
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])

    def token_logprobs(self, prompts, completions, params):
        return [sampling_logprobs(self.logits, p)[0, c] for c, p in zip(completions, params)]


def test_the_reference_log_probs_for_the_kl_cover_tokens_outside_its_top_k():
    algo = TokenPolicyGradient(SimpleNamespace(beta=0.1, global_std=False, adv_clip=5.0), RunConfig())
    sample = Sample(request=None, latents=None, sigmas=None, logprobs=None, output="",
                    prompt_tokens=None, completion=torch.tensor([2]),
                    sampling=SamplingParams(top_k=2, temperature=0.7))
    unit = SequenceUnit(sample)
    cut = algo._logprobs(_TokenModel(), [unit])[0]
    assert torch.isinf(cut).all()  # under the sampling distribution's top-2 cut: -inf, the KL's inf/NaN
    algo.reference_prepare(_TokenModel(), [unit])
    expected = torch.log_softmax(_TokenModel.logits / 0.7, dim=-1)[0, 2]  # temperature kept, no cut
    assert torch.isfinite(unit.ref_logprobs).all() and torch.allclose(unit.ref_logprobs, expected)


@pytest.mark.parametrize("kind", ["sde", "dance"])
def test_stochastic_log_probs_refuse_a_zero_noise_level(kind):
    x = torch.zeros(1, 4)
    mean, std = step_mean(kind, x, x, torch.tensor([0.8]), torch.tensor([0.6]), eta=0.0)
    assert torch.equal(std, torch.zeros(1))  # the mean is the ODE's; only a log-prob has no meaning
    with pytest.raises(ValueError, match="needs a noise level eta > 0"):
        transition_logprob(kind, x, mean, std)
