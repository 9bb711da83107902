"""omnirl algorithm plugin: Diffusion-DPO for flow matching (online pairs, or offline preference files)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="dpo",
            aliases=("diffusion-dpo", "flow-dpo"),
            description="Diffusion-DPO: best vs worst of a group (or a preference file), shared noise and level "
            "per pair, no log-probs.",
            factory="omnirl_plugin_dpo.algorithm:DiffusionDPO",
            config="omnirl_plugin_dpo.algorithm:DPOConfig",
            requires=frozenset({"flow-matching"}),
            needs_logprobs=False,
            needs_reference=True,
            needs_pairs=True,
            preset_defaults={
                # random-weight tiny models: errors are large and pairs few (4 groups), so a smaller beta,
                # more pairs and draws per group
                "tiny": {"algorithm": {"options": {"beta": 100.0, "pairs_per_group": 2, "noise_draws": 2}}},
            },
        )
    )
