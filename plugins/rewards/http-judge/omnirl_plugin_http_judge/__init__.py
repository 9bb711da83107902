"""omnirl reward plugin: a remote judge over HTTP (JSON in, JSON out; never pickle)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="http-judge",
            aliases=("vlm-judge-http",),
            description="POSTs each image (base64 PNG) and its prompt as JSON to a judge service; the reply's "
            "score is the reward.",
            factory="omnirl_plugin_http_judge.reward:HTTPJudge",
            config="omnirl_plugin_http_judge.reward:HTTPJudgeOptions",
            modality="image",
            batched=False,
            resources={"CPU": 0.1},  # waits on the network; encodes one PNG per image
        )
    )
