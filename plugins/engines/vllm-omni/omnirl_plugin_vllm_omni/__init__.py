"""omnirl engine plugin: vllm-omni as the rollout engine of flow models, in an environment of its own
(`omnirl env build vllm-omni`). Importing this module is cheap: no torch, no vllm."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="vllm-omni",
            aliases=("vllm_omni",),
            description="vllm-omni serving the flow model in a server process of its own environment: its "
            "step-wise batching, omnirl's sampler steps (trajectory + per-step log-probs), LoRA sync from "
            "tensors. Qwen-Image.",
            factory="omnirl_plugin_vllm_omni.engine:VllmOmniRolloutEngine",
            config="omnirl_plugin_vllm_omni.engine:VllmOmniRolloutOptions",
            roles=frozenset({"rollout"}),
            devices=frozenset({"cpu", "cuda"}),
        )
    )
