"""omnirl hardware plugin: the CPU (always available; gloo for torch.distributed)."""

from omnirl_core import hookimpl
from omnirl_core.registry import DeviceSpec


def probe() -> int:
    return 1


@hookimpl
def omnirl_register_devices(register):
    register(
        DeviceSpec(
            name="cpu",
            description="CPU; torch.distributed over gloo; Ray resource CPU.",
            factory="omnirl_plugin_cpu:probe",
            torch_device="cpu",
            backend="gloo",
            ray_resource="CPU",
            visible_devices_env="",
            priority=0,
        )
    )
