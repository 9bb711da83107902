"""omnirl hardware plugin: the CPU (always available; gloo for torch.distributed)."""


def probe() -> int:
    return 1
