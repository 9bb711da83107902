"""omnirl engine plugin: the embedded rollout engine over the flow-model contract."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="diffusers",
            description="Embedded rollout engine: batched denoising over the model contract, core sampler, "
            "per-request seeds.",
            factory="omnirl_plugin_diffusers.engine:DiffusersRolloutEngine",
            config="omnirl_plugin_diffusers.engine:DiffusersRolloutOptions",
            roles=frozenset({"rollout"}),
            devices=frozenset({"cpu", "cuda", "npu"}),
        )
    )
