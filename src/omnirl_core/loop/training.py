"""Helpers every train engine uses: micro-batching and metric averaging (also across ranks)."""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from omnirl_core.algorithm import Algorithm, lacks_reference
from omnirl_core.contracts import PolicyModel, TrainingUnit
from omnirl_core.errors import OmnirlError

if TYPE_CHECKING:
    import torch

    from omnirl_core.config import TrainSection

T = TypeVar("T")
U = TypeVar("U", bound=TrainingUnit)


class NonFiniteError(OmnirlError):
    """A loss or gradient that is NaN or infinite, found before the optimizer step that would apply it."""


def finite_update(grad_norm: float, losses: list[float], step: int, minibatch: int, policy: str,
                  metrics: MetricMean) -> bool:
    """Whether to take the optimizer step of a minibatch: every loss and the (all-reduced) gradient norm
    finite. Otherwise ``train.nonfinite``: 'stop' raises before the weights change (the run's last checkpoint
    stays as it is), 'skip' drops this minibatch's gradient and counts it."""
    bad = not math.isfinite(grad_norm) or not all(math.isfinite(v) for v in losses)
    metrics.add({"train/skipped_minibatches": float(bad)}, 1.0)
    if not bad:
        return True
    if policy == "skip":
        return False
    raise NonFiniteError(
        f"Non-finite training numbers at step {step}, minibatch {minibatch + 1}: grad_norm={grad_norm}, "
        f"losses={[round(v, 6) if math.isfinite(v) else v for v in losses][:8]}. The optimizer step was not "
        "taken and nothing of this step is saved.",
        hint="Lower train.lr or raise clipping; check logprob/abs_delta_max in metrics.jsonl; or set "
        "train.nonfinite=skip to skip such minibatches. Rerun the same command to resume from the last checkpoint.",
    )


def micro_batch(train: TrainSection, units: int) -> int:
    """Transitions per forward/backward call when a call covers up to ``units`` (a rank's share of a minibatch):
    ``train.micro_batch_size``, or all of them with ``auto`` (the launch's memory plan replaces ``auto`` with a
    number where the whole share would not fit the device)."""
    size = train.micro_batch_size
    return max(1, units) if size == "auto" else size


def prepare_batch(train: TrainSection, units: int) -> int:
    """The micro-batch of the no-grad pass over a step's ``units`` (the old log-probs, the reference): the size of
    one minibatch's calls, so that it needs no more memory than the update."""
    return micro_batch(train, -(-units // train.minibatches))


def chunks(items: list[T], size: int) -> list[list[T]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def split_even(items: list[T], parts: int) -> list[list[T]]:
    """``parts`` contiguous pieces whose sizes differ by at most one (some empty when parts > len; none when
    parts is 0)."""
    if parts <= 0:
        return []
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


class MetricMean:
    """Averages metrics weighted by how many units each value covers; '*_max' keys keep the maximum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        """Weight 0 only registers the keys (a rank with nothing to report must still name them for
        ``all_reduce``); its values count for nothing, maxima included."""
        for key, value in metrics.items():
            if key.endswith("_max"):
                floor = self.maxes.get(key, float("-inf"))
                self.maxes[key] = max(floor, float(value)) if weight > 0 else floor
            else:
                self.sums[key] += float(value) * weight
                self.weights[key] += weight

    def all_reduce(self, device: torch.device | str = "cpu") -> None:
        """Combine every rank's metrics (all ranks call this with the same keys); ``device``: where the
        backend's tensors live (CPU for gloo, the accelerator for nccl / hccl)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        keys, max_keys = sorted(self.sums), sorted(self.maxes)
        digest = int.from_bytes(hashlib.sha1("|".join(keys + ["#"] + max_keys).encode()).digest()[:7], "big")
        check = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if int(check[0]) != digest or int(check[1]) != -digest:
            raise RuntimeError("train ranks reported different metric names; every rank must log the same keys")
        sums = torch.tensor([[self.sums[k], self.weights[k]] for k in keys], dtype=torch.float64,
                            device=device).reshape(-1, 2)
        dist.all_reduce(sums)
        for k, (s, w) in zip(keys, sums.tolist()):
            self.sums[k], self.weights[k] = s, w
        if max_keys:
            maxes = torch.tensor([self.maxes[k] for k in max_keys], dtype=torch.float64, device=device)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            self.maxes.update(zip(max_keys, maxes.tolist()))

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}
        out.update({k: v for k, v in self.maxes.items() if v != float("-inf")})
        return out


def prepare_all(algorithm: Algorithm, model: PolicyModel, units: list[TrainingUnit], micro_batch_size: int,
                metrics: MetricMean,
                reference: Callable[[], list[dict[str, Any]]] | None = None) -> None:
    """The no-grad pass before the update: ``algorithm.prepare`` over every unit in micro-batches (old
    log-probs), then the reference policy's outputs when the algorithm uses a reference.

    ``reference``: None evaluates the reference here (``model.reference()``: the adapters disabled, or the
    frozen copy); otherwise a callable that waits for a separate reference worker's outputs for ``units``. It
    is called after the actor's own pass, so that pass overlaps the reference worker's."""
    import torch

    with torch.no_grad():
        for micro in chunks(units, micro_batch_size):
            metrics.add(algorithm.prepare(model, micro), len(micro))
        if not algorithm.uses_reference:
            return
        if reference is not None:
            attach_reference(units, reference())
        elif lacks_reference(algorithm, units):
            with model.reference():
                for micro in chunks(units, micro_batch_size):
                    algorithm.reference_prepare(model, micro)


def attach_reference(units: list[TrainingUnit], payload: list[dict[str, Any]]) -> None:
    """Put a reference worker's outputs (``Worker.reference_outputs``) on the actor's copy of the units."""
    if len(payload) != len(units):
        raise RuntimeError(f"reference worker returned {len(payload)} results for {len(units)} units")
    for unit, fields in zip(units, payload):
        for name, value in fields.items():
            setattr(unit, name, value)


def sample_blocks(units: list[U]) -> list[list[U]]:
    """Units grouped by the sample they come from (a unit of no single sample, ``sample`` None, is its own group),
    in order."""
    groups: dict[int, list[U]] = {}
    for unit in units:
        groups.setdefault(id(unit.sample if unit.sample is not None else unit), []).append(unit)
    return list(groups.values())


def minibatches(units: list[U], count: int, step: int, shuffle: bool) -> list[list[U]]:
    """Whole samples shuffled (seeded by step, so every rank and every engine agrees) and split into
    ``count`` minibatches: all trained steps of a sample land in one minibatch, so its sequence IS weight
    is formed from evaluations at the same weights (rollout correction)."""
    import torch

    blocks = sample_blocks(units)
    order = list(range(len(blocks)))
    if shuffle:
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(step)).tolist()
    size = -(-len(blocks) // min(count, len(blocks)))
    ordered = [blocks[i] for i in order]
    return [[u for block in ordered[i:i + size] for u in block] for i in range(0, len(ordered), size)]


def rank_share(units: list[U], rank: int, world_size: int) -> list[U]:
    """A rank's share of a minibatch: every world-th sample, whole (its steps stay on one rank)."""
    return [u for block in sample_blocks(units)[rank::world_size] for u in block]


def rs_corrections(algorithm: Algorithm, units: list[TrainingUnit], metrics: MetricMean,
                   filler: Sequence[TrainingUnit] = ()) -> list[TrainingUnit]:
    """After a minibatch's micro-batches, before its optimizer step: the algorithm's sequence-level
    diagnostics over the whole samples, and the units whose rejection-sampling mask changed once all of
    their sample's steps were seen (bypass mode). The engine re-runs those with ``loss(..., correction=True)``,
    which adds (final mask - applied mask) x their loss, so the gradient equals masking with the final
    weights from the start. Rejections are rare, so this costs little.
    ``filler``: units evaluated on this rank only to join the collectives; with no units of its own the rank
    reports the diagnostics' names from them at weight 0 (ranks must report the same metric names)."""
    if not (units or filler):
        return []
    if not units:
        metrics.add({**algorithm.finish_minibatch(list(filler))[1], "rs/corrected_units": 0.0}, 0.0)
        return []
    fix, seq_metrics = algorithm.finish_minibatch(units)
    metrics.add(seq_metrics, len(sample_blocks(units)))
    metrics.add({"rs/corrected_units": float(len(fix))}, 1.0)
    return fix
