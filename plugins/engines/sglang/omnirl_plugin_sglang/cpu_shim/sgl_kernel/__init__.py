"""An import-only stand-in for SGLang's CPU kernel library, used by the SGLang server on a CPU where the real
``sgl_kernel`` (built from SGLang's source for CPUs, Intel AMX / AVX-512 oriented) is not installed. Never on
a GPU, never where the real one is importable (``omnirl_plugin_sglang.server.use_cpu_shim``).

SGLang 0.5.23 imports some of its CPU kernels unconditionally on a CPU: ``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` (KV cache moves) and the speculative-decoding helpers, and some model modules take
``torch.ops.sgl_kernel.<op>_cpu`` at import (Qwen3.5's gated norms, which its Qwen-VL processor module pulls
in). The layers the Qwen3-Omni thinker runs use their pure-torch ``forward_native`` path when the kernel
library is missing (SGLang checks ``torch.ops.sgl_kernel.convert_weight_packed``, which this stand-in does not
define), so none of these is called on that path. Each one here raises if it is called: nothing is emulated.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+omnirl.cpu.shim"

# taken at import time by SGLang 0.5.23's modules on a CPU (torch.ops.sgl_kernel.<name>)
OPS = ("rmsnorm_cpu", "fused_dual_residual_rmsnorm_cpu", "fused_moe_router_cpu", "fused_qk_gemma_rmsnorm_cpu",
       "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu",
       "fused_sigmoid_mul_cpu")


class KernelMissing(NotImplementedError):
    pass


def _missing(name: str):
    def call(*args, **kwargs):
        raise KernelMissing(
            f"sgl_kernel.{name} was called, but this is omnirl's import-only stand-in for SGLang's CPU kernels: "
            "this model or option needs SGLang's CPU kernel library (sgl-kernel built from source for CPUs).")

    call.__name__ = name
    return call


_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
for _name in OPS:
    if not hasattr(torch.ops.sgl_kernel, _name):
        _LIB.define(f"{_name}(Tensor[] args) -> ()")
        _LIB.impl(_name, _missing(_name), "CompositeExplicitAutograd")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
