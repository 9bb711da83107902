"""omnirl tracker plugin: Weights & Biases. Importing this module is cheap: wandb is imported at start."""

from omnirl_core import hookimpl
from omnirl_core.registry import TrackerSpec


@hookimpl
def omnirl_register_trackers(register):
    register(
        TrackerSpec(
            name="wandb",
            description="Weights & Biases: metrics, sample grids and reward histograms; online or offline "
            "(WANDB_MODE=offline, synced later with `wandb sync`); a resumed run continues the same W&B run.",
            factory="omnirl_plugin_wandb.tracker:WandbTracker",
            config="omnirl_plugin_wandb.tracker:WandbOptions",
            requires=("wandb",),
        )
    )
