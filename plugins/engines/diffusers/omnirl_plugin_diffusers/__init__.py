"""omnirl engine plugin: the embedded rollout engine over the flow-model contract."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="diffusers",
            description="Embedded rollout engine: step-wise continuous batching over the model contract "
            "(also static and one-at-a-time modes), prompt-embedding cache, core sampler, per-request seeds.",
            factory="omnirl_plugin_diffusers.engine:DiffusersRolloutEngine",
            config="omnirl_plugin_diffusers.engine:DiffusersRolloutOptions",
            roles=frozenset({"rollout"}),
            devices=frozenset({"cpu", "cuda", "npu"}),
        )
    )
