"""omnirl reward plugin: a VLM judge over the OpenAI-compatible chat-completions API.

Cheap to import: the factory and the options are ``"module:attr"`` strings, so httpx, numpy and torch load
only when a run uses the reward.
"""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="vlm-judge",
            # the names of the reward this one replaces, so that old configs still resolve
            aliases=("http-judge", "vlm-judge-http"),
            description="Asks a VLM served with an OpenAI-compatible chat-completions API (vLLM, SGLang) to "
            "judge each image against its prompt; the parsed score is the reward.",
            factory="omnirl_plugin_vlm_judge.reward:VLMJudge",
            config="omnirl_plugin_vlm_judge.options:VLMJudgeOptions",
            modality="image",
            batched=True,  # a batch is judged with up to `concurrency` requests in flight
            resources={"CPU": 0.1},  # waits on the network; encodes one PNG per image
        )
    )
