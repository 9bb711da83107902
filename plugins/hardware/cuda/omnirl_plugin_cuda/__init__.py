"""omnirl hardware plugin: NVIDIA GPUs through CUDA (nccl; Ray resource GPU; CUDA_VISIBLE_DEVICES)."""


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
