"""omnirl hardware plugin: Huawei Ascend NPUs through torch-npu (hccl; Ray resource NPU;
ASCEND_RT_VISIBLE_DEVICES). Importing this module is cheap: torch-npu is imported only by the probe."""


def probe() -> int:
    """Number of usable NPUs; 0 without torch-npu or hardware (never raises).

    Importing torch_npu registers the ``npu`` device type and the ``hccl`` backend with torch, so every
    worker process calls this before it touches the device."""
    from importlib.util import find_spec

    try:
        if find_spec("torch_npu") is None:
            return 0
        import torch
        import torch_npu  # noqa: F401  registers torch.npu

        return int(torch.npu.device_count()) if torch.npu.is_available() else 0
    except Exception:  # noqa: BLE001  a probe must never take a run down (missing CANN libraries, ...)
        return 0
