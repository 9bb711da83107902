"""omnirl algorithm plugin: FlowGRPO (online RL for flow-matching models via an SDE rollout)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="flowgrpo",
            aliases=("flow-grpo",),
            description="FlowGRPO: Flow-SDE rollout with log-probs, group advantages, clipped ratio, KL to the "
            "base model.",
            factory="omnirl_plugin_flowgrpo.algorithm:FlowGRPO",
            config="omnirl_plugin_flowgrpo.algorithm:FlowGRPOConfig",
            requires=frozenset({"flow-matching", "sde-logprob"}),
            needs_logprobs=True,
            needs_reference=True,
        )
    )
