"""The policy-gradient machinery token-level algorithms share (GSPO, GRPO) over the AR contract
(``omnirl_core.ar``). An algorithm plugin subclasses ``TokenPolicyGradient`` and writes only its objective
(``surrogate``). Nothing here names a model.

One training unit is one sampled sequence. Log-probs are padded to (N, T) with a mask of real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from omnirl_core.algorithm import Algorithm
from omnirl_core.ar.sampling import completion_tokens, untruncated
from omnirl_core.config import RunConfig
from omnirl_core.contracts import RolloutPlan, Sample, TokenModel, TrainingUnit
from omnirl_core.rl.advantage import assign_group_advantages
from omnirl_core.rl.correction import rs_mask, sequence_diagnostics

AR_PLAN = RolloutPlan(step_kinds=(), train_steps=())
"""AR rollouts have no denoising steps: the rollout engine's sampling options define the distribution."""

T = TypeVar("T")


def _present(value: T | None, what: str) -> T:
    """A field a token sample or unit must have by now (its trajectory, a prepared log-prob)."""
    assert value is not None, f"a token sequence without its {what}"
    return value


@dataclass
class SequenceUnit(TrainingUnit):
    """One sampled completion and the log-probs the update compares it with."""

    sample: Sample
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    log_weight: float = 0.0
    """Recompute mode: log of the sequence IS weight, from ``prepare``."""

    @property
    def rollout_logprobs(self) -> torch.Tensor:
        return _present(self.sample.logprobs, "log-probs")


def padded(rows: list[torch.Tensor], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths -> (N, T) fp32 values (0 where padded) and the (N, T) mask of real tokens."""
    from torch.nn.utils.rnn import pad_sequence

    values = pad_sequence([r.to(device).float() for r in rows], batch_first=True)
    mask = pad_sequence([torch.ones(len(r), device=device) for r in rows], batch_first=True)
    return values, mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's real tokens: (N, T) -> (N,)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def sequence_log_weights(logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                         aggregate: str = "mean") -> torch.Tensor:
    """log w per sequence from its token deltas (trainer - rollout), mean or sum over real tokens: (N,)."""
    delta = (logp.detach().float() - rollout.float()) * mask
    return delta.sum(-1) / mask.sum(-1).clamp_min(1.0) if aggregate == "mean" else delta.sum(-1)


def mismatch_metrics(logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Trainer vs rollout log-probs per token: |delta| mean / max and the k3 estimate of KL(rollout || train)."""
    delta = (logp.detach() - rollout)[mask.bool()].double()
    return {
        "logprob/abs_delta_mean": float(delta.abs().mean()),
        "logprob/abs_delta_max": float(delta.abs().max()),
        "is/kl_k3": float((torch.exp(delta) - 1 - delta).mean()),
    }


def part_metrics(model: TokenModel, units: list[SequenceUnit], trainer: list[torch.Tensor],
                 gap: bool = True) -> dict[str, float]:
    """A model whose completions are several modules' draws (``TokenModel.logprob_parts``): per part, the mean over
    sequences of its log-prob sum under the trainer (``logprob/<part>/sum``) and its entry count (``.../length``), and
    (``gap``: where the trainer's weights are the rollout's) the largest trainer-vs-rollout gap of one entry
    (``.../abs_delta_max``). Nothing for a one-module model."""
    if not model.logprob_parts:
        return {}
    metrics: dict[str, float] = {}
    parts = [model.logprob_part_of(completion_tokens(u.sample)).cpu() for u in units]
    for k, name in enumerate(model.logprob_parts):
        sums, lengths, gaps = [], [], [0.0]
        for u, part, logp in zip(units, parts, trainer):
            mine = part == k
            values = logp.detach().cpu().double()[mine]
            sums.append(float(values.sum()))
            lengths.append(float(mine.sum()))
            if len(values):
                gaps.append(float((values - u.rollout_logprobs.cpu().double()[mine]).abs().max()))
        metrics[f"logprob/{name}/sum"] = sum(sums) / len(sums)
        metrics[f"logprob/{name}/length"] = sum(lengths) / len(lengths)
        if gap:
            metrics[f"logprob/{name}/abs_delta_max"] = max(gaps)
    return metrics


class TokenPolicyGradient(Algorithm[TokenModel, SequenceUnit]):
    """Group-normalised advantages, old log-probs (recomputed or the rollout's), optional KL to the
    reference. Subclasses read ``adv_clip``, ``global_std`` and ``beta`` from their own config class."""

    reference_fields = ("ref_logprobs",)

    def __init__(self, options: Any, config: RunConfig):
        super().__init__(options, config)
        self.uses_reference = options.beta > 0

    def plan(self, step: int) -> RolloutPlan:
        return AR_PLAN

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        adv = assign_group_advantages(samples, global_std=self.options.global_std, clip=self.options.adv_clip,
                                     rewards=self.config.rewards)
        lengths = torch.tensor([float(len(_present(s.logprobs, "log-probs"))) for s in samples])
        return {"advantage/abs_mean": float(adv.abs().mean()), "response_length/mean": float(lengths.mean())}

    def training_units(self, samples: list[Sample]) -> list[SequenceUnit]:
        return [SequenceUnit(s) for s in samples]

    def _logprobs(self, model: TokenModel, units: list[SequenceUnit], uncut: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs under the sampling distribution, or (``uncut``) without its top-k / top-p
        cut: a sampled token may lie outside the reference's top-k, where the cut distribution gives -inf."""
        return self._scored(model, units, (uncut,))[0]

    def _scored(self, model: TokenModel, units: list[SequenceUnit],
                cuts: tuple[bool, ...]) -> list[list[torch.Tensor]]:
        """Per-token log-probs under the sampling distribution (False) and / or uncut (True), one list per entry
        of ``cuts`` (``TokenModel.token_logprobs_under``: one forward pass for a causal LM)."""
        samples = [u.sample for u in units]
        # passed through as the model takes them (a test double may hold None)
        prompts: list[Any] = [s.prompt_tokens for s in samples]
        completions = [completion_tokens(s) for s in samples]
        params: list[Any] = [s.sampling for s in samples]
        distributions: list[list[Any]] = [[untruncated(p) if p is not None else p for p in params] if uncut
                                          else params for uncut in cuts]
        if len(distributions) > 1:
            return model.token_logprobs_under(prompts, completions, distributions)
        return [model.token_logprobs(prompts, completions, distributions[0])]

    def prepare(self, model: TokenModel, units: list[SequenceUnit]) -> dict[str, float]:
        """Without grad, before the update: old log-probs (recompute mode)."""
        metrics: dict[str, float] = {}
        if self.recompute:
            old = self._logprobs(model, units)
            for u, lp in zip(units, old):
                u.old_logprobs = lp.detach()
            logp, mask = padded(old, model.device)
            rollout, _ = padded([u.rollout_logprobs for u in units], model.device)
            metrics.update(mismatch_metrics(logp, rollout, mask))
            metrics.update(part_metrics(model, units, old))
            log_w = sequence_log_weights(logp, rollout, mask, self.config.train.rs_aggregate)
            for u, w in zip(units, log_w.tolist()):
                u.log_weight = w
        return metrics

    def reference_prepare(self, model: TokenModel, units: list[SequenceUnit]) -> None:
        """Without grad, ``model`` being the reference policy: its per-token log-probs over its whole support
        (temperature and allowed tokens applied, no top-k / top-p), so the KL term stays finite."""
        for u, lp in zip(units, self._logprobs(model, units, uncut=True)):
            u.ref_logprobs = lp.detach()

    def surrogate(self, logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                  adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-sequence policy loss (N,) and metrics, from (N, T) log-probs and the (N,) advantages."""
        raise NotImplementedError

    def loss(self, model: TokenModel, units: list[SequenceUnit], first_update: bool = False,
             correction: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of a micro-batch (mean over its sequences) and metrics. ``correction`` is never set
        here: one unit is one whole sequence, so ``finish_minibatch`` has no unit to re-run."""
        device = model.device
        # ratio: the sampling distribution, as rolled out; KL: both sides uncut (a token can leave top-k/p)
        scored = self._scored(model, units, (False, True) if self.uses_reference else (False,))
        logp, mask = padded(scored[0], device)
        rollout, _ = padded([u.rollout_logprobs for u in units], device)
        old = padded([_present(u.old_logprobs, "old log-probs") for u in units], device)[0] if self.recompute \
            else rollout
        adv = torch.tensor([u.sample.advantage for u in units], device=device)
        # rollout correction: a sequence whose IS weight (trainer vs rollout) leaves train.rs_band is
        # rejected whole. One unit is one whole sequence, so the weight is exact in both modes.
        if self.recompute:
            log_w = torch.tensor([u.log_weight for u in units], dtype=torch.float32)
        else:
            log_w = sequence_log_weights(logp, rollout, mask, self.config.train.rs_aggregate).cpu()
        keep = rs_mask(log_w, self.config.train.rs_band)
        per_seq, metrics = self.surrogate(logp, old, mask, adv)
        metrics.update(sequence_diagnostics(units, log_w, keep))
        policy_loss = (per_seq * keep.to(device)).mean()
        metrics["policy_loss"] = float(policy_loss.detach())
        metrics.update(part_metrics(model, units, scored[0], gap=first_update and not self.recompute))
        loss = policy_loss
        if self.uses_reference:
            # k3 estimator of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1
            ref, _ = padded([_present(u.ref_logprobs, "reference log-probs") for u in units], device)
            diff = ref - padded(scored[1], device)[0]
            kl = masked_mean(torch.exp(diff) - diff - 1.0, mask).mean()
            loss = loss + self.options.beta * kl
            metrics["kl"] = float(kl.detach())
        if first_update and not self.recompute:
            metrics.update(mismatch_metrics(logp, rollout, mask))
        return loss, metrics
