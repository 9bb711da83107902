"""What megatron-core 0.16 needs to run here: two CPU shims (nothing on a GPU), and one fix of its own.

megatron-core places its tensors with ``torch.cuda.current_device()`` (the all-gather buffers of its
tensor-parallel mappings and of the MoE token dispatcher, the rotary frequencies, a few scalars) and forks a CUDA
random-number state around attention dropout. On a CPU build of torch both raise. Two shims, active only when the
engine trains on a CPU:

- ``cpu_placement()``: while the engine runs megatron-core code (building the model, an update, a state
  exchange), ``torch.cuda.current_device`` returns ``"cpu"``; the original is put back afterwards, so nothing
  else in the process sees the change.
- ``install_cpu_rng_tracker(seed)``: megatron's model-parallel RNG tracker (module state of megatron-core) keeps
  a CPU generator state per name instead of a CUDA one. Dropout is 0 in the policy, so it draws nothing; the
  fork only has to work.

And on every device, ``router_without_transformer_engine()``: megatron-core 0.16.1's MoE router reads the name
``te_general_gemm``, which its ``moe_utils`` defines only when Transformer Engine imports (a NameError without it;
every other Transformer Engine function there is guarded by ``HAVE_TE``). The engine defines it as None, the
value the code tests for, so the router takes its plain ``torch.mm`` path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint

_lock = threading.RLock()
_depth = 0


def _cpu_device() -> str:
    return "cpu"


@contextlib.contextmanager
def cpu_placement(active: bool) -> Iterator[None]:
    """``torch.cuda.current_device()`` answers ``"cpu"`` inside the block when ``active`` (the engine's device is
    a CPU); re-entrant, restored on exit."""
    global _depth
    if not active:
        yield
        return
    from megatron.core import tensor_parallel

    with _lock:
        original = torch.cuda.current_device
        checkpoint = tensor_parallel.checkpoint
        if _depth == 0:
            torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
            tensor_parallel.checkpoint = _torch_checkpoint
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.current_device = original
                tensor_parallel.checkpoint = checkpoint


def _torch_checkpoint(function: Any, distribute_saved_activations: bool, *args: Any) -> Any:
    """megatron's activation recompute (``recompute_granularity="full"``) on a CPU: its ``CheckpointFunction`` saves
    and restores CUDA RNG states; torch's non-reentrant checkpoint does the same recompute with the CPU's."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def install_cpu_rng_tracker(seed: int) -> None:
    """Replace megatron's CUDA RNG tracker by one over CPU generator states, its three states seeded as
    ``model_parallel_cuda_manual_seed`` seeds them."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    tracker: Any = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
                + parallel_state.get_expert_tensor_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def router_without_transformer_engine() -> None:
    """Define ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when Transformer Engine is absent
    (see the module docstring); nothing when it is there."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
