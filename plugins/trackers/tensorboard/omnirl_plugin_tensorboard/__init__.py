"""omnirl tracker plugin: TensorBoard. Importing this module is cheap: no torch, no tensorboard."""

from omnirl_core import hookimpl
from omnirl_core.registry import TrackerSpec


@hookimpl
def omnirl_register_trackers(register):
    register(
        TrackerSpec(
            name="tensorboard",
            aliases=("tb",),
            description="TensorBoard event files in RUN_DIR/tensorboard: every metric as a scalar, the sample "
            "grids as images, per-sample rewards as histograms; a resumed run purges the steps it redoes.",
            factory="omnirl_plugin_tensorboard.tracker:TensorBoardTracker",
            config="omnirl_plugin_tensorboard.tracker:TensorBoardOptions",
            requires=("tensorboard",),
        )
    )
