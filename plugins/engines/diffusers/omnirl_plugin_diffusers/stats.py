"""What one ``generate`` call did: model calls, slots, padding, latencies and where the time went."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class RolloutStats:
    """Counters of one ``generate`` call.

    A *slot* is one row of a model call's batch; every call offers ``max_num_seqs`` slots. A *useful* row
    advances a request by one step; a *padding* row is computed and thrown away (a finished request that a
    static batch still carries). ``cost`` weighs a row by latent elements times CFG branches (what the
    transformer computes), so ``padding_share`` is the share of compute spent on padding.
    """

    mode: str
    max_num_seqs: int
    model_calls: int = 0
    useful_rows: int = 0
    padding_rows: int = 0
    useful_cost: float = 0.0
    padding_cost: float = 0.0
    drain_calls: int = 0
    """Model calls made with no request left waiting (the tail, where buckets empty one by one)."""
    drain_useful_rows: int = 0
    decode_calls: int = 0
    samples: int = 0
    max_active: int = 0
    started: float = 0.0
    ended: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: {
        "velocity": 0.0, "sampler": 0.0, "decode": 0.0, "admit": 0.0, "idle": 0.0})
    latencies: list[float] = field(default_factory=list)
    """Per returned sample: finish time - arrival time, seconds."""
    encode: dict[str, float] = field(default_factory=dict)
    """Text-encoder work of this call (``EncodeStats`` fields: calls, prompts, hits, seconds)."""

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    def summary(self) -> dict[str, float]:
        rows = self.useful_rows + self.padding_rows
        cost = self.useful_cost + self.padding_cost
        slots = self.model_calls * self.max_num_seqs
        busy = self.wall_s - self.seconds["idle"]
        other = busy - sum(v for k, v in self.seconds.items() if k != "idle")
        return {
            "samples": self.samples,
            "wall_s": self.wall_s,
            "throughput": self.samples / self.wall_s if self.wall_s > 0 else float("nan"),
            "latency_mean_s": sum(self.latencies) / len(self.latencies) if self.latencies else float("nan"),
            "latency_p95_s": percentile(self.latencies, 95),
            "model_calls": self.model_calls,
            "mean_batch_rows": rows / self.model_calls if self.model_calls else float("nan"),
            "slot_utilisation": self.useful_rows / slots if slots else float("nan"),
            "slot_utilisation_queued": _ratio(self.useful_rows - self.drain_useful_rows,
                                              (self.model_calls - self.drain_calls) * self.max_num_seqs),
            "slot_utilisation_drain": _ratio(self.drain_useful_rows, self.drain_calls * self.max_num_seqs),
            "drain_calls": self.drain_calls,
            "padding_share": self.padding_cost / cost if cost else 0.0,
            "decode_calls": self.decode_calls,
            "max_active": self.max_active,
            **{f"time_{k}_s": v for k, v in self.seconds.items()},
            "time_other_s": other,
            **{f"encode_{k}": v for k, v in self.encode.items()},
        }
