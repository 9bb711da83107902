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
            preset_defaults={
                # random-weight tiny models: per-group std (prompts differ a lot in reward), a wider clip
                # for lr 1e-2, and a light KL
                "tiny": {"algorithm": {"options": {"clip_range": 1e-3, "beta": 0.004, "global_std": False}}},
            },
        )
    )
