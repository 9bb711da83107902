"""Test plugin: a reward that misbehaves on purpose (``faulty``), to check that every fault ends in a retry, a
clear error within the deadline, or a counted drop; never a hang, a silent 0 or a NaN in training.

Option ``mode``: ok | raise | hang | nan | count | str | bool | none | slow | fail-odd (fails on every other
call).
``from_call``: misbehave from this call on (earlier calls answer normally)."""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core import hookimpl
from omnirl_core.contracts import Reward
from omnirl_core.registry import RewardSpec


class FaultyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: str = Field("ok", description="How to misbehave.")
    from_call: int = Field(0, ge=0, description="Misbehave from this call on.")
    delay_s: float = Field(0.2, ge=0, description="Seconds a 'slow' call takes.")


class Faulty(Reward):
    def __init__(self, options: FaultyOptions | None = None):
        self.options = options or FaultyOptions()
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, outputs, prompts):
        with self._lock:
            call = self.calls
            self.calls += 1
        good = [float(o.float().mean()) for o in outputs]  # the image's mean: a learnable, well-formed score
        mode = self.options.mode if call >= self.options.from_call else "ok"
        if mode == "ok":
            return good
        if mode == "raise":
            raise RuntimeError("the scorer crashed")
        if mode == "hang":
            threading.Event().wait()  # forever
        if mode == "nan":
            return [float("nan")] * len(outputs)
        if mode == "count":
            return good + [0.5]
        if mode == "str":
            return [f"{v:.2f}" for v in good]
        if mode == "bool":
            return [True] * len(outputs)
        if mode == "none":
            return None
        if mode == "slow":
            threading.Event().wait(self.options.delay_s)
            return good
        if mode == "fail-odd" and call % 2:
            raise RuntimeError("fails on every other call")
        return good


@hookimpl
def omnirl_register_rewards(register):
    register(RewardSpec(name="faulty", factory="faulty_rewards:Faulty", config="faulty_rewards:FaultyOptions",
                        modality="image", description="misbehaves on purpose (tests)",
                        default_prompts=["a red square", "a blue circle", "a green field", "a white wall"]))
