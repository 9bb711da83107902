"""omnirl reward plugin: GenEval-style compositional reward on OWLv2 (no mmdet)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="geneval",
            description="GenEval's checks (objects, counts, colours, positions) from GenEval metadata records or "
            "template prompts, on transformers' OWLv2 detector and a CLIP colour classifier; tiny preset.",
            factory="omnirl_plugin_geneval.reward:GenEval",
            config="omnirl_plugin_geneval.reward:GenEvalOptions",
            modality="image",
            default_prompts="omnirl_plugin_geneval.reward:DEFAULT_PROMPTS",
        )
    )
