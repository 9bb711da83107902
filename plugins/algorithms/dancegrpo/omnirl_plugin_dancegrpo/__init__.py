"""omnirl algorithm plugin: DanceGRPO (Dance-SDE, shared group noise, random trained steps)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="dancegrpo",
            aliases=("dance-grpo",),
            description="DanceGRPO: Dance-SDE rollout from shared group noise, a random subset of steps trained, "
            "per-reward advantages summed.",
            factory="omnirl_plugin_dancegrpo.algorithm:DanceGRPO",
            config="omnirl_plugin_dancegrpo.algorithm:DanceGRPOConfig",
            requires=frozenset({"flow-matching", "sde-logprob"}),
            needs_logprobs=True,
            needs_reference=True,
            preset_defaults={
                # random-weight tiny models: a wider clip for lr 1e-2 and the MixGRPO noise level, under which
                # the tiny model's samples differ enough within a group
                "tiny": {"algorithm": {"options": {"clip_range": 1e-3, "noise_level": 0.7}}},
            },
        )
    )
