"""Measured peak memory, to check the planner's estimates against: the allocator's own figures.

CUDA: ``torch.cuda.max_memory_allocated``. CPU torch keeps no peak statistic, but its profiler records every
allocation with the allocator's running total (``profile_memory=True``); the peak is the largest total seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _events(nodes: Any) -> Iterator[Any]:  # Any: nodes of torch's profiler event tree (an untyped private API)
    for node in nodes:
        yield node
        yield from _events(node.children)


def cpu_peak_bytes(run: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held above what it held when ``run()`` started."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    allocations = sorted((n for n in _events(prof.profiler.kineto_results.experimental_event_tree())
                          if n.tag.name == "Allocation"), key=lambda n: n.start_time_ns)
    if not allocations:
        return 0
    first = allocations[0].extra_fields
    base = first.total_allocated - first.alloc_size
    return max(n.extra_fields.total_allocated for n in allocations) - base


def peak_bytes(run: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated on ``device`` while ``run()`` executes, above the level when it started."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_peak_bytes(run)


def training_step_peak_bytes(module: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> int:
    """Peak CPU bytes of ``loss().backward()`` through ``module``, measured on a second step: the first creates
    what lives on between steps (RoPE caches, the gradients' buffers), which the planner counts elsewhere."""
    loss().backward()
    for p in module.parameters():
        p.grad = None
    return cpu_peak_bytes(lambda: loss().backward())
