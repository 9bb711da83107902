"""omnirl reward plugin: remote (a reward served by `omnirl reward serve NAME`)."""

from omnirl_core import hookimpl
from omnirl_core.registry import RewardSpec


@hookimpl
def omnirl_register_rewards(register):
    register(
        RewardSpec(
            name="remote",
            description="A reward served over HTTP by `omnirl reward serve NAME` (its own environment or GPU): "
            "JSON with PNG images / PNG video frames, no pickle; batched on the server.",
            factory="omnirl_plugin_remote.reward:RemoteReward",
            config="omnirl_plugin_remote.reward:RemoteOptions",
            modality="any",
        )
    )
