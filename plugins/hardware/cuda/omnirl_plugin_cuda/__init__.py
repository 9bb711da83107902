"""omnirl hardware plugin: NVIDIA GPUs through CUDA (nccl; Ray resource GPU; CUDA_VISIBLE_DEVICES)."""

from omnirl_core import hookimpl
from omnirl_core.registry import DeviceSpec


def probe() -> int:
    """Number of usable CUDA devices; 0 when torch has no CUDA (never raises)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - a device probe never fails a run: no CUDA is 0 devices
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a device probe never fails a run: no CUDA is 0 devices
        return 0


@hookimpl
def omnirl_register_devices(register):
    register(
        DeviceSpec(
            name="cuda",
            aliases=("gpu",),
            description="NVIDIA GPU; torch.distributed over nccl; Ray resource GPU.",
            factory="omnirl_plugin_cuda:probe",
            torch_device="cuda",
            backend="nccl",
            ray_resource="GPU",
            visible_devices_env="CUDA_VISIBLE_DEVICES",
            priority=10,
        )
    )
