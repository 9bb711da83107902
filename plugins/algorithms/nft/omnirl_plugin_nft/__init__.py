"""omnirl algorithm plugin: DiffusionNFT (forward-process fine-tuning with an EMA sampler policy)."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="nft",
            aliases=("diffusion-nft", "diffusionnft"),
            description="DiffusionNFT: implicit positive/negative policies trained on the forward process, "
            "deterministic rollout with an EMA sampler policy, no log-probs.",
            factory="omnirl_plugin_nft.algorithm:DiffusionNFT",
            config="omnirl_plugin_nft.algorithm:NFTConfig",
            requires=frozenset({"flow-matching"}),
            needs_logprobs=False,
            needs_reference=True,
            needs_ema=True,
            recipe_defaults={"rollout": {"guidance_scale": 1.0}},
            preset_defaults={
                # random-weight tiny models: per-group std (prompts differ a lot in reward) and two noise
                # draws per sample (32 samples a step is little data for a regression loss)
                "tiny": {"algorithm": {"options": {"global_std": False, "timesteps_per_sample": 2}}},
            },
        )
    )
