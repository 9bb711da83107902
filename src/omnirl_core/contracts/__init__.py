"""Every seam of omnirl as a type: the data that crosses them (``data``), models (``model``), rollout and train
engines (``engines``), rewards (``reward``), and the runtime's executor, training units and trackers
(``runtime``). The algorithm's contract is ``omnirl_core.algorithm.Algorithm``; a device's is its spec
(``omnirl_core.registry.DeviceSpec``). Optional behaviour is declared (a class attribute or a method with a
default), never probed: the runtime reads the declaration.

Importing this package loads no torch."""

from omnirl_core.contracts.data import (
    TRAJECTORY_FIELDS,
    Conditioning,
    GenRequest,
    RolloutPlan,
    Sample,
    Speech,
)
from omnirl_core.contracts.engines import RolloutEngine, TrainEngine
from omnirl_core.contracts.model import FlowModel, PolicyModel, TokenModel
from omnirl_core.contracts.reward import CallableReward, Reward, as_reward
from omnirl_core.contracts.runtime import Executor, Tracker, TrainingUnit

__all__ = [
    "TRAJECTORY_FIELDS", "CallableReward", "Conditioning", "Executor", "FlowModel", "GenRequest", "PolicyModel",
    "Reward", "RolloutEngine", "RolloutPlan", "Sample", "Speech", "TokenModel", "Tracker", "TrainEngine", "TrainingUnit",
    "as_reward",
]
