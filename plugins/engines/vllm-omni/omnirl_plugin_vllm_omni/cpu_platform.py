"""A CPU platform for vllm-omni (it ships none), for tests and development on machines without a GPU.

Registered through vllm-omni's entry-point group ``vllm_omni.platform_plugins`` and active only when asked
(``OMNIRL_VLLM_OMNI_CPU=1``, which the omnirl engine sets on a CPU run) and never where CUDA is available:
on a GPU machine vllm-omni's own CUDA platform is used. Attention runs through torch SDPA (vllm-omni's
TORCH_SDPA backend, whose CUDA path is plain torch); memory figures come from psutil. It covers the
engine's plumbing (requests, custom pipeline, step hooks, LoRA, outputs), not its kernels or speed.
"""

from __future__ import annotations

import logging
import os

ENV = "OMNIRL_VLLM_OMNI_CPU"
log = logging.getLogger("omnirl")


def register() -> str | None:
    """vllm-omni's platform-plugin hook: the platform's class path, or None to stay out of the way."""
    if os.environ.get(ENV) != "1":
        return None
    import torch

    if torch.cuda.is_available():
        log.warning("%s=1 ignored: CUDA is available, vllm-omni's CUDA platform is used.", ENV)
        return None
    return "omnirl_plugin_vllm_omni.cpu_platform_impl.CpuOmniPlatform"
