"""omnirl algorithm plugin: MixGRPO (mixed ODE-SDE rollout with a sliding SDE window; Flash variant)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="mixgrpo",
            aliases=("mix-grpo",),
            description="MixGRPO: SDE and training only inside a sliding window of steps, ODE elsewhere; Flash: "
            "second-order ODE after the window.",
            factory="omnirl_plugin_mixgrpo.algorithm:MixGRPO",
            config="omnirl_plugin_mixgrpo.algorithm:MixGRPOConfig",
            requires=frozenset({"flow-matching", "sde-logprob"}),
            needs_logprobs=True,
            needs_reference=True,
            preset_defaults={
                # random-weight tiny models: per-group std, a wider clip for lr 1e-2, more steps than the
                # model's tiny default so that the window has room to slide
                "tiny": {
                    "rollout": {"num_steps": 8},
                    "algorithm": {"options": {"window_size": 2, "window_shift_interval": 10,
                                              "clip_range": 1e-3, "noise_level": 0.7}},
                },
            },
        )
    )
