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
                # random-weight tiny models (6 steps): a window of 4 that visits starts 0 and 1, the Flow-SDE,
                # independent initial noise, a wider clip for lr 1e-2. Measured on this preset: windows of 3
                # steps or group-shared noise learn several times more slowly within 200 steps.
                "tiny": {"algorithm": {"options": {
                    "sampler": "sde", "window_size": 4, "window_max_start": 1, "window_shift_interval": 100,
                    "shared_initial_noise": False, "clip_range": 1e-3}}},
            },
        )
    )
