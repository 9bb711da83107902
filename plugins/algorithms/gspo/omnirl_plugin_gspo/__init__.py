"""omnirl algorithm plugin: GSPO and token-level GRPO for autoregressive (ar-text) models. Cheap: no torch."""

from omnirl_core import hookimpl
from omnirl_core.registry import AlgorithmSpec

# random-weight tiny models move far from their init within a few steps: a wider trust region than the
# papers' (which assume a pretrained policy and lr ~1e-6)
_TINY_GSPO = {"algorithm": {"options": {"clip_low": 0.02, "clip_high": 0.03}}}


@hookimpl
def omnirl_register_algorithms(register):
    register(
        AlgorithmSpec(
            name="gspo",
            description="GSPO: sequence-level importance ratio exp(mean token log-ratio), clipped; group-normalised "
            "advantages; no KL by default.",
            factory="omnirl_plugin_gspo.algorithm:GSPO",
            config="omnirl_plugin_gspo.algorithm:GSPOConfig",
            requires=frozenset({"ar-text"}),
            needs_logprobs=True,
            needs_reference=True,  # only when beta > 0
            preset_defaults={"tiny": _TINY_GSPO},
        )
    )
    register(
        AlgorithmSpec(
            name="grpo",
            description="GRPO: token-level clipped ratio, mean over each sequence's tokens, group-normalised "
            "advantages, optional k3 KL to the base model.",
            factory="omnirl_plugin_gspo.algorithm:GRPO",
            config="omnirl_plugin_gspo.algorithm:GRPOConfig",
            requires=frozenset({"ar-text"}),
            needs_logprobs=True,
            needs_reference=True,  # only when beta > 0
        )
    )
