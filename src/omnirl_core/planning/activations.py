"""Activation memory from the real architecture, traced on the ``meta`` device: no weights, no memory.

A model's trained network runs one forward and backward pass on meta tensors of the configured shapes (its
LoRA adapters, or every weight trained; gradient checkpointing as configured) while a dispatch mode follows every
tensor the operators create until nothing references it: the largest total alive at once is the activation peak.
Weights, inputs and weight gradients are excluded (they are counted apart). Fused attention is assumed (flash /
memory-efficient kernels keep q, k, v, the output and the log-sum-exp, never the T x T matrix), as on every
accelerator and in CPU torch; the meta device would otherwise take the math path. Traces at one block and at two
give what one block adds; the real depth follows by arithmetic, so a 60-block 20B transformer costs the time of a
2-block trace. The no-grad passes (a rollout step, CFG's unconditional branch) are traced the same way.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_key(t: torch.Tensor) -> int:
    # meta tensors have no data pointer; the storage object's own address tells storages apart everywhere
    return t.untyped_storage()._cdata


class FusedAttention(TorchFunctionMode):
    """Scaled-dot-product attention through the fused kernel's autograd node (what it saves: q, k, v, the output,
    the log-sum-exp), whatever device the tensors are on: the meta device would otherwise take the math path and
    keep the full attention matrix, which no accelerator run does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        values = dict(zip(names, args))
        values.update(kwargs)
        q, k, v = values["query"], values["key"], values["value"]
        if values.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
        mask = values.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=0.0, is_causal=bool(values.get("is_causal", False)), attn_mask=mask,
            scale=values.get("scale"))[0]


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the tensors operators create that are still referenced, and their maximum."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key in self.exclude:
                    continue
                entry = self.refs.get(key)
                if entry is None:
                    entry = self.refs[key] = [t.untyped_storage().nbytes(), 0]
                    self.live += entry[0]
                    self.peak = max(self.peak, self.live)
                entry[1] += 1
                weakref.finalize(t, self._release, key)
        return out


def peak_live_bytes(module: torch.nn.Module, run: Callable[[], Any]) -> int:
    """The most bytes of intermediate tensors alive at once while ``run()`` executes (no grad: a rollout step, a
    VAE decode), inputs and parameters excluded. Works on meta tensors."""
    exclude = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
    mode = _LiveBytes(exclude)
    with torch.no_grad(), FusedAttention(), mode:
        run()
    return mode.peak


@dataclass
class DenoiserProbe:
    """What a model contributes so that the planner can trace its trained network.

    ``build(n)``: the network at full width with ``n`` blocks, on ``meta`` (the real configuration otherwise);
    ``layers``: its real number of blocks; ``blocks(module)``: the blocks gradient checkpointing wraps;
    ``inputs(module, batch)``: the forward's keyword arguments for ``batch`` samples at the configured resolution
    (meta tensors, the model dtype); ``lora_targets``: the adapted layers (the plugin's defaults)."""

    build: Callable[[int], torch.nn.Module]
    layers: int
    blocks: Callable[[torch.nn.Module], Sequence[torch.nn.Module]]
    inputs: Callable[[torch.nn.Module, int], dict[str, Any]]
    lora_targets: tuple[str, ...] | str = ()
    key: tuple[Any, ...] = ()
    """Everything the traces depend on (architecture, dtype, input shapes, targets): probes with equal non-empty
    keys share their traces within a process (a plan's alternatives, several recipes)."""


@dataclass
class Activations:
    """Activation bytes of one micro-batch through one trained network (weights and their gradients apart)."""

    peak: int
    """Peak above the weights over the forward and backward pass: the saved tensors, then the backward pass's
    working set (with checkpointing, one block recomputed at a time)."""
    saved: int
    """What the forward pass leaves alive for the backward pass."""
    no_grad_peak: int
    """Peak of one no-grad forward of the same batch (a rollout step; CFG's unconditional branch)."""
    checkpointing: bool

    def with_cfg(self) -> int:
        """The peak when training also runs CFG's unconditional branch, without grad, after the conditional one."""
        return max(self.peak, self.saved + self.no_grad_peak)


def _checkpoint_with_fused_attention(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # the recomputation runs in autograd's thread, outside this thread's function modes: give it its own
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: (FusedAttention(), FusedAttention()), **kwargs)


def _prepare(module: torch.nn.Module, lora_rank: int | None, lora_targets: tuple[str, ...] | str,
             checkpointing: bool) -> torch.nn.Module:
    """``module`` as training sees it: frozen, with LoRA adapters (or every parameter trained), checkpointed."""
    module.requires_grad_(False)
    if lora_rank:
        from peft import LoraConfig, inject_adapter_in_model

        targets = lora_targets if isinstance(lora_targets, str) else list(lora_targets)
        module = inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=targets),
                                         module)
        for name, p in module.named_parameters():
            p.requires_grad_("lora_" in name)
        from omnirl_core.precision import upcast_adapters

        upcast_adapters(module.parameters())  # as the workers hold them: a float32 master copy
    else:
        module.requires_grad_(True)
    if checkpointing:
        if hasattr(module, "enable_gradient_checkpointing"):  # diffusers
            module.enable_gradient_checkpointing(  # type: ignore[operator]  # diffusers' ModelMixin
                gradient_checkpointing_func=_checkpoint_with_fused_attention)
        else:  # transformers
            module.gradient_checkpointing_enable(  # type: ignore[operator]  # transformers' PreTrainedModel
                gradient_checkpointing_kwargs={"use_reentrant": False,
                                               "context_fn": lambda: (FusedAttention(), FusedAttention())})
    return module


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return _first(output[0])
    for name in ("sample", "logits", "last_hidden_state"):
        if getattr(output, name, None) is not None:
            return getattr(output, name)
    raise TypeError(f"cannot find the output tensor in {type(output).__name__}")


def _trace(probe: DenoiserProbe, layers: int, batch: int, lora_rank: int | None, checkpointing: bool,
           grad: bool = True) -> tuple[int, int]:
    """(peak, alive after the forward pass) of one forward (+ backward) at ``layers`` blocks."""
    module = probe.build(layers)
    if grad:
        module = _prepare(module, lora_rank, probe.lora_targets, checkpointing).train()
        for p in module.parameters():  # gradients are counted apart from activations: drop them once made
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    else:
        module.eval()
    inputs = probe.inputs(module, batch)
    exclude = ({_storage_key(t) for t in (*module.parameters(), *module.buffers())}
               | {_storage_key(v) for v in inputs.values() if isinstance(v, torch.Tensor)})
    mode = _LiveBytes(exclude)
    with FusedAttention(), mode, torch.set_grad_enabled(grad):
        out = _first(module(**inputs))
        after_forward = mode.live
        if grad:
            out.float().square().mean().backward()
        del out
    return mode.peak, after_forward


def _linear(one: int, two: int, n: int) -> int:
    """The value at ``n`` from those at 1 and 2, when each unit adds the same (a block; a sample)."""
    return one + (n - 1) * (two - one)


_TRACES: dict[tuple[Any, ...], tuple[int, int]] = {}


@functools.lru_cache(maxsize=1)
def _libraries() -> tuple[str, ...]:
    """What a trace depends on besides its key: the versions of what builds and runs the modules, and this
    module's own code."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    out = [hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]]
    for name in ("omnirl", "torch", "diffusers", "transformers", "peft"):
        try:
            out.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            out.append(f"{name}=-")
    return tuple(out)


def stored(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """``compute()`` memoised on disk (``$OMNIRL_CACHE/plan-traces``) under ``key`` and the libraries' versions: a
    trace is a pure function of them, and every run checks its plan before it starts (the same plan again costs
    nothing). Values are JSON (numbers, lists); an unreadable entry is computed anew."""
    import hashlib
    import json
    import os

    from omnirl_core.presets import cache_dir

    digest = hashlib.sha256(repr((key, _libraries())).encode()).hexdigest()[:32]
    path = cache_dir() / "plan-traces" / f"{digest}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next plan its trace
        pass
    return value


def _cached(probe: DenoiserProbe, layers: int, batch: int, lora_rank: int | None, checkpointing: bool,
            grad: bool) -> tuple[int, int]:
    """``_trace`` at ``batch`` from traces at 1 and 2 samples (every tensor grows with the batch), memoised on the
    probe (and, for a probe with a key, on disk: ``stored``): a plan and its alternatives reuse them."""
    cache = _TRACES if probe.key else probe.__dict__.setdefault("_traces", {})
    values = []
    for b in (1, 2):
        key = (probe.key, layers, b, lora_rank, checkpointing, grad)
        if key not in cache:
            def trace(b: int = b) -> tuple[int, int]:
                return _trace(probe, layers, b, lora_rank, checkpointing, grad)

            cache[key] = tuple(stored(("trace",) + key, trace)) if probe.key else trace()
        values.append(cache[key])
    (peak_1, alive_1), (peak_2, alive_2) = values
    return _linear(peak_1, peak_2, batch), _linear(alive_1, alive_2, batch)


def trace_activations(probe: DenoiserProbe, batch: int, lora_rank: int | None, checkpointing: bool) -> Activations:
    """Activations of one forward + backward of ``batch`` samples through the full-depth network."""
    (peak_1, saved_1), (peak_2, saved_2) = (_cached(probe, n, batch, lora_rank, checkpointing, True) for n in (1, 2))
    return Activations(peak=_linear(peak_1, peak_2, probe.layers), saved=_linear(saved_1, saved_2, probe.layers),
                       no_grad_peak=no_grad_peak(probe, batch), checkpointing=checkpointing)


def no_grad_peak(probe: DenoiserProbe, batch: int) -> int:
    """Peak intermediates of one no-grad forward of ``batch`` samples (a rollout step): what one block holds at
    once, whatever the depth (each block's intermediates are freed before the next runs)."""
    return _cached(probe, 1, batch, None, False, False)[0]


def meta_cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` with floating-point parameters and buffers in ``dtype`` (as a checkpoint loaded in that dtype)."""
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)


def transformer_activation_bytes(tokens: int, hidden: int, layers: int, batch: int, dtype_bytes: int,
                                 checkpointing: bool, tensor: int = 1) -> int:
    """A generic estimate for a model without a probe: a transformer layer with fused attention keeps about
    17 hidden-size vectors per token (34 bytes x hidden in 16-bit; Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", Sec. 4.1), one per layer with checkpointing (plus one layer
    recomputed). ``tensor``: the tensor-parallel degree, without sequence parallelism: 5 + 12 / t vectors
    (Sec. 4.2.1, sbh(10 + 24/t)): the layer inputs, norms and dropout masks stay whole on every rank."""
    per_layer = (5 * tensor + 12) * tokens * hidden * batch * dtype_bytes // tensor
    if checkpointing:
        return layers * tokens * hidden * batch * dtype_bytes + per_layer
    return layers * per_layer
