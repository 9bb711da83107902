"""Options every learned reward plugin has (where its model runs, in which dtype, its tiny preset), so that a
reward plugin declares only what is its own (checkpoint paths, scoring settings)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ModelRewardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    preset: Literal["tiny"] | None = Field(None, description="'tiny': random-weight models of the same "
                                           "architectures, built once in $OMNIRL_CACHE/presets (ignores the paths).")
    device: str = Field("auto", description="Device: auto (cuda if available), cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Model weights' dtype.")


class BatchedRewardOptions(ModelRewardOptions):
    batch_size: int = Field(32, ge=1, description="Images per forward pass.")
