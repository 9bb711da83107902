"""The CPU platform class (imported by vllm-omni only when the platform is active; see ``cpu_platform``).
It must not import vllm-omni's attention modules: they import the platform.

Importing it also keeps vLLM's linear layers on plain weights: on a CPU, vLLM prepacks every unquantized
linear weight for its GEMM kernels after loading and drops the parameter (an empty tensor remains), so a
later in-place weight load (the engine's full-weight sync) would never reach the computation. Here the
layers compute with ``torch.nn.functional.linear`` on the loaded parameter, as on a GPU, where vLLM keeps
the weights as they are. Slower on a large model, and nothing here is about CPU speed.
"""

from __future__ import annotations

import psutil
import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


def _keep_plain_weights(self, layer: torch.nn.Module) -> None:
    layer.cpu_linear = torch.nn.functional.linear


UnquantizedLinearMethod.process_weights_after_loading = _keep_plain_weights


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend, head_size, allow_trtllm_default=False) -> str:
        if selected_backend not in (None, "TORCH_SDPA", "SDPA"):
            raise ValueError(f"The omnirl CPU platform runs attention through torch SDPA only, not "
                             f"{selected_backend}; leave the diffusion attention backend unset.")
        return "omnirl_plugin_vllm_omni.cpu_attention.CpuSDPABackend"  # imported by vllm-omni, later

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank=None):
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls):
        return None

    @classmethod
    def get_device_capability(cls, device_id=0):
        return None

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def is_initialized(cls) -> bool:
        return True

    @classmethod
    def get_free_memory(cls, device=None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device=None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    # no device to synchronise, set, or account for
    @classmethod
    def synchronize(cls):
        return None

    @classmethod
    def set_device(cls, device):
        return None

    @classmethod
    def empty_cache(cls):
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device=None):
        return None

    @classmethod
    def record_device_event(cls):
        return None

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device=None) -> int:
        return 0
