"""omnirl algorithm plugin: GRPO-Guard (FlowGRPO with a normalised ratio and per-step reweighting)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="grpo-guard",
            aliases=("grpoguard", "grpo_guard"),
            description="GRPO-Guard: FlowGRPO with a zero-mean normalised ratio and each step's loss divided by "
            "its step size.",
            factory="omnirl_plugin_grpo_guard.algorithm:GRPOGuard",
            config="omnirl_plugin_grpo_guard.algorithm:GRPOGuardConfig",
            requires=frozenset({"flow-matching", "sde-logprob"}),
            needs_logprobs=True,
            needs_reference=True,
            preset_defaults={
                # random-weight tiny models: per-group std, a clip wide enough for lr 1e-2, a light KL
                "tiny": {"algorithm": {"options": {"clip_range": 1e-3, "beta": 0.004, "global_std": False}}},
            },
        )
    )
