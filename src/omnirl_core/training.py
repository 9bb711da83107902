"""Helpers every train engine uses: micro-batching and metric averaging (also across ranks)."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def split_even(items: list[Any], parts: int) -> list[list[Any]]:
    """``parts`` contiguous pieces whose sizes differ by at most one (some empty when parts > len)."""
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
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, float("-inf")), float(value))
            else:
                self.sums[key] += float(value) * weight
                self.weights[key] += weight

    def all_reduce(self) -> None:
        """Combine every rank's metrics (all ranks call this with the same keys)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        keys, max_keys = sorted(self.sums), sorted(self.maxes)
        digest = int.from_bytes(hashlib.sha1("|".join(keys + ["#"] + max_keys).encode()).digest()[:7], "big")
        check = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if int(check[0]) != digest or int(check[1]) != -digest:
            raise RuntimeError("train ranks reported different metric names; every rank must log the same keys")
        sums = torch.tensor([[self.sums[k], self.weights[k]] for k in keys], dtype=torch.float64).reshape(-1, 2)
        dist.all_reduce(sums)
        for k, (s, w) in zip(keys, sums.tolist()):
            self.sums[k], self.weights[k] = s, w
        if max_keys:
            maxes = torch.tensor([self.maxes[k] for k in max_keys], dtype=torch.float64)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            self.maxes.update(zip(max_keys, maxes.tolist()))

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}
        out.update(self.maxes)
        return out


def prepare_all(algorithm: Any, model: Any, units: list[Any], micro_batch_size: int, metrics: MetricMean) -> None:
    """``algorithm.prepare`` over every unit, without grad (old log-probs, reference outputs)."""
    import torch

    with torch.no_grad():
        for micro in chunks(units, micro_batch_size):
            metrics.add(algorithm.prepare(model, micro), len(micro))


def minibatches(units: list[Any], count: int, step: int, shuffle: bool) -> list[list[Any]]:
    """Units shuffled (seeded by step, so every rank and every engine agrees) and split into ``count``."""
    import torch

    order = list(range(len(units)))
    if shuffle:
        order = torch.randperm(len(units), generator=torch.Generator().manual_seed(step)).tolist()
    ordered = [units[i] for i in order]
    size = -(-len(units) // min(count, len(units)))
    return chunks(ordered, size)
