"""omnirl engine plugin: vLLM as the rollout engine of autoregressive models, in an environment of its own
(`omnirl env build vllm`). Importing this module is cheap: no torch, no vllm."""

from omnirl_core import hookimpl
from omnirl_core.registry import EngineSpec


@hookimpl
def omnirl_register_engines(register):
    register(
        EngineSpec(
            name="vllm",
            description="vLLM serving an autoregressive model (the Qwen3-Omni thinker) in a server process of its "
            "own environment: continuous batching, per-token log-probs of the sampling distribution, trained "
            "weights synced from tensors.",
            factory="omnirl_plugin_vllm.engine:VllmRolloutEngine",
            config="omnirl_plugin_vllm.engine:VllmRolloutOptions",
            roles=frozenset({"rollout"}),
            devices=frozenset({"cpu", "cuda"}),
        )
    )
