"""omnirl engine plugin: the embedded rollout engine for autoregressive models. Cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="transformers",
            aliases=("hf-generate",),
            description="Embedded rollout engine for AR models: batched transformers generate, per-request seeds, "
            "per-token log-probs of the distribution actually sampled.",
            factory="omnirl_plugin_transformers.engine:TransformersRolloutEngine",
            config="omnirl_plugin_transformers.engine:TransformersRolloutOptions",
            roles=frozenset({"rollout"}),
            devices=frozenset({"cpu", "cuda", "npu"}),
        )
    )
