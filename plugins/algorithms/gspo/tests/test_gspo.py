"""GSPO and token-level GRPO objectives on hand-made log-probs (no model), plus one CLI run of GRPO."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omnirl_plugin_gspo.algorithm import GRPO, GSPO, GRPOConfig, GSPOConfig

from omnirl_core.ar.policy_gradient import SequenceUnit, padded
from omnirl_core.config import RunConfig
from omnirl_core.contracts import TokenModel
from omnirl_core.loop.training import MetricMean, prepare_all
from omnirl_core.testing import run_train

PLUGIN = Path(__file__).resolve().parents[1] / "omnirl_plugin_gspo"


def _rows(*values: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(v) for v in values]


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    algo = GSPO(GSPOConfig(clip_low=0.5, clip_high=0.5), RunConfig())
    old, mask = padded(_rows([-1.0, -2.0, -0.5], [-3.0]), "cpu")
    logp = (old + torch.tensor([[0.1, -0.3, 0.05], [0.2, 0.0, 0.0]]) * mask).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    loss, metrics = algo.surrogate(logp, old, mask, adv)
    s = torch.tensor([math.exp((0.1 - 0.3 + 0.05) / 3), math.exp(0.2)])
    torch.testing.assert_close(loss.detach(), -adv * s)
    assert metrics["ratio/mean"] == pytest.approx(float(s.mean()))
    loss.sum().backward()
    # d(-A s)/d logp_t = -A s / T on real tokens, 0 on padding
    torch.testing.assert_close(logp.grad[0], torch.full((3,), -1.0 * float(s[0]) / 3))
    torch.testing.assert_close(logp.grad[1], torch.tensor([2.0 * float(s[1]), 0.0, 0.0]))


def test_gspo_clips_asymmetrically_and_stops_those_gradients():
    algo = GSPO(GSPOConfig(clip_low=0.01, clip_high=0.02), RunConfig())
    old = torch.zeros(4, 2)
    mask = torch.ones(4, 2)
    # sequence log-ratios: +0.03 (above 1 + e_high), -0.015 (below 1 - e_low), +0.015, +0.005
    logp = torch.tensor([[0.03] * 2, [-0.015] * 2, [0.015] * 2, [0.005] * 2], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, metrics = algo.surrogate(logp, old, mask, adv)
    loss.sum().backward()
    assert torch.all(logp.grad[0] == 0) and torch.all(logp.grad[1] == 0)  # clipped where it would gain
    assert torch.all(logp.grad[2] != 0) and torch.all(logp.grad[3] != 0)
    assert metrics["clip_frac"] == pytest.approx(0.5)  # rows 0 and 1 lie outside [0.99, 1.02]
    assert float(loss[0].detach()) == pytest.approx(-1.02)


def test_grpo_is_token_level_and_ignores_padding():
    algo = GRPO(GRPOConfig(clip_low=0.2, clip_high=0.2), RunConfig())
    old, mask = padded(_rows([-1.0, -1.0], [-2.0, -2.0, -2.0]), "cpu")
    delta = torch.tensor([[0.5, 0.0, 0.0], [0.1, -0.1, 0.0]])
    logp = old + delta * mask
    adv = torch.tensor([1.0, 1.0])
    loss, _ = algo.surrogate(logp, old, mask, adv)
    # row 0: token ratios 1.2 (clipped from e^0.5) and 1 -> mean -(1.2 + 1) / 2
    assert float(loss[0]) == pytest.approx(-(1.2 + 1.0) / 2)
    assert float(loss[1]) == pytest.approx(-(math.exp(0.1) + math.exp(-0.1) + 1.0) / 3)
    # garbage in the padded slot changes nothing
    logp2 = logp.clone()
    logp2[0, 2] = 7.0
    torch.testing.assert_close(algo.surrogate(logp2, old, mask, adv)[0], loss)


def _samples(rewards: list[float], groups: list[int]):
    return [SimpleNamespace(reward=r, request=SimpleNamespace(group=g), logprobs=torch.zeros(3), advantage=0.0)
            for r, g in zip(rewards, groups)]


def test_advantages_are_normalised_per_group():
    algo = GSPO(None, RunConfig())
    samples = _samples([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0], [0, 0, 0, 0, 1, 1, 1, 1])
    metrics = algo.assign_advantages(samples)
    adv = [s.advantage for s in samples]
    assert adv[0] == pytest.approx(0.75 / (math.sqrt(3 / 16) + 1e-4), rel=1e-4)
    assert adv[4:] == [0.0] * 4  # a group with one reward teaches nothing
    assert metrics["response_length/mean"] == 3.0


class _FakePolicy:
    """Stands in for an AR model at the algorithm's boundary: fixed per-token log-probs, a reference."""

    device = torch.device("cpu")

    def __init__(self, current: list[torch.Tensor], reference: list[torch.Tensor]):
        self.current, self.ref, self.in_ref = current, reference, False

    def token_logprobs(self, prompts, completions, params):
        return self.ref if self.in_ref else self.current

    token_logprobs_under = TokenModel.token_logprobs_under  # the contract's default: once per distribution
    logprob_parts = TokenModel.logprob_parts  # the contract's default: one module

    def reference(self):
        policy = self

        class _Ctx:
            def __enter__(self):
                policy.in_ref = True

            def __exit__(self, *exc):
                policy.in_ref = False

        return _Ctx()


def test_kl_to_the_reference_is_the_k3_estimate():
    current = _rows([-1.0, -2.0], [-0.5])
    ref = _rows([-1.2, -2.0], [-0.1])
    samples = [SimpleNamespace(logprobs=c.clone(), advantage=0.0,
                               prompt_tokens=None, completion=torch.zeros(len(c)), sampling=None)
               for c in current]
    algo = GRPO(GRPOConfig(beta=0.1), RunConfig())
    assert algo.uses_reference
    units = [SequenceUnit(s) for s in samples]
    policy = _FakePolicy(current, ref)
    metrics = MetricMean()
    prepare_all(algo, policy, units, 8, metrics)  # the runtime's no-grad pass: old log-probs, then the reference
    assert metrics.result()["logprob/abs_delta_max"] == 0.0
    loss, m = algo.loss(policy, units)

    def k3(d: float) -> float:
        return math.exp(d) - d - 1

    expected = ((k3(-0.2) + k3(0.0)) / 2 + k3(0.4)) / 2
    assert m["kl"] == pytest.approx(expected, rel=1e-5)
    assert float(loss) == pytest.approx(0.1 * expected, rel=1e-5)  # zero advantages: only the KL term
    assert not GSPO(None, RunConfig()).uses_reference  # beta 0: no reference forward


@pytest.mark.parametrize("mode", ["recompute", "bypass"])
def test_rs_mask_rejects_a_sequence_whose_rollout_logprobs_disagree(mode: str):
    """Rollout correction on token sequences: the rollout engine's log-probs of the second sequence are 1.0
    lower per token than the trainer's, so its IS weight is e > 2 and the band [0.5, 2] rejects it whole."""
    current = _rows([-1.0, -2.0], [-0.5])
    rollout = _rows([-1.0, -2.0], [-1.5])
    samples = [SimpleNamespace(logprobs=r.clone(), advantage=1.0,
                               prompt_tokens=None, completion=torch.zeros(len(r)), sampling=None)
               for r in rollout]
    config = RunConfig()
    config.train.old_logprob = mode
    algo = GSPO(None, config)
    units = [SequenceUnit(s) for s in samples]
    policy = _FakePolicy(current, current)
    algo.prepare(policy, units)
    loss, metrics = algo.loss(policy, units)
    assert metrics["rs/rejected_frac"] == pytest.approx(0.5)
    assert metrics["is/seq_weight_max"] == pytest.approx(math.e, rel=1e-5)
    old = padded(current if mode == "recompute" else rollout, "cpu")[0]
    logp, mask = padded(current, "cpu")
    per_seq, _ = algo.surrogate(logp, old, mask, torch.ones(2))
    assert float(loss) == pytest.approx(float(per_seq[0]) / 2)  # only the first sequence counts
    config.train.rs_band = None
    assert algo.loss(policy, units)[1]["rs/rejected_frac"] == 0.0


def test_no_model_is_named_in_the_algorithm_code():
    text = " ".join(p.read_text().lower() for p in PLUGIN.glob("*.py"))
    for name in ("qwen", "thinker", "wan2", "sd3", "llama"):
        assert name not in text, name


def test_grpo_runs_end_to_end_through_the_cli(tmp_path: Path):
    pytest.importorskip("omnirl_plugin_qwen3_omni")  # the AR model it trains here
    records = run_train(tmp_path / "run", "--model", "qwen3-omni", "--algo", "grpo", "--preset", "tiny",
                        "--steps", "2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                        "--set", "algorithm.options.beta=0.01", "--set", "train.minibatches=1")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["logprob/abs_delta_max"] < 1e-5
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at zero: policy = reference
