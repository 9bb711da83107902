"""Test plugin: a model without the sde-logprob capability, and a reward; used to check capability
refusal and duplicate names without loading any real model."""

from omnirl_core import hookimpl
from omnirl_core.registry import ModelSpec, RewardSpec


@hookimpl
def omnirl_register_models(register):
    register(ModelSpec(name="ode-only", factory="builtins:object", capabilities=frozenset({"flow-matching", "image"})))


@hookimpl
def omnirl_register_rewards(register):
    register(RewardSpec(name="jpeg", factory="builtins:object", description="a second 'jpeg' (duplicate name)"))
