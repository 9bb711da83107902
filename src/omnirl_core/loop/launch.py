"""Starting a run from a resolved config: the run directory (default name, identity check, resume decision,
lock), the prompt data opened and checked before anything is written, and the dry-run plan.

What ``omnirl train`` does, for Python users too::

    launch = Launch.prepare(manager, resolved)
    print(launch.plan())            # the dry run
    launch.claim(manager)           # True: resuming
    Controller(resolved, launch.run_path, data=launch.data).run()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.resolve import ResolvedRun
from omnirl_core.rundir.rundir import RunDir

if TYPE_CHECKING:
    from omnirl_core.data.sources import PromptData
    from omnirl_core.planning.planner import MemoryPlan
    from omnirl_core.plugins import PluginManager


def default_run_dir(resolved: ResolvedRun) -> Path:
    """``run.output_dir``, or ``runs/<model>-<algorithm>-<timestamp>``."""
    if resolved.config.run.output_dir:
        return Path(resolved.config.run.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{resolved.model.name}-{resolved.algorithm.name}-{stamp}"


@dataclass
class Launch:
    resolved: ResolvedRun
    run_path: Path
    dump: dict[str, Any]
    data: PromptData | None = None
    """The opened ``PromptData`` (None only in a dry run whose prompts are missing: ``data_problem``)."""
    data_problem: str | None = None
    memory: MemoryPlan | None = None
    """The memory plan the run was checked against (``omnirl_core.planning``), or None when the model has none."""
    device_type: str | None = None
    """The torch device type the run uses (``cpu``, ``cuda``, ...), None when no device of its kind is here."""

    @classmethod
    def prepare(cls, manager: PluginManager, resolved: ResolvedRun, dry_run: bool = False) -> Launch:
        """Everything that can fail before a run touches its directory: the trackers' options, the run
        directory's identity (a directory holding another run is refused), the prompt data, and the memory the
        run needs against the device it runs on (``check_memory``: the same check in a dry run)."""
        from omnirl_core.data.sources import NoPromptsError, open_run_data
        from omnirl_core.loop.trackers import resolve_trackers

        resolve_trackers(manager, resolved.config, resolved)  # unknown trackers and bad options fail here
        run_path = default_run_dir(resolved)
        dump = resolved.dump()
        dump["run"]["output_dir"] = str(run_path)
        launch = cls(resolved, run_path, dump)
        RunDir(run_path).check(dump)
        try:
            launch.data = open_run_data(resolved)
        except NoPromptsError as err:
            if not dry_run:
                raise
            launch.data_problem = err.render()  # the plan is shown; the run itself would stop here
        launch.check_memory(manager)
        return launch

    def check_memory(self, manager: PluginManager) -> None:
        """The memory plan of the run against the memory of the device it uses (``plan.memory.check_run_memory``):
        exit 2 when it cannot fit. A dry run resolves the device by name only (nothing touches it); a device that
        is not here leaves the plan without a verdict."""
        from omnirl_core.errors import OmnirlError
        from omnirl_core.planning.memory import check_run_memory
        from omnirl_core.resolve import resolve_device

        device = self.resolved.device
        if device is None:
            try:
                device = resolve_device(manager, self.resolved.config.run.device)
            except OmnirlError:
                device = None
        self.device_type = device.torch_device if device is not None else None
        self.memory = check_run_memory(self.resolved, self.device_type)

    def plan(self) -> dict[str, Any]:
        """What the run would do: the dry run's answer."""
        r, cfg = self.resolved, self.resolved.config
        return {
            "run_dir": str(self.run_path),
            "model": f"{r.model.qualified_name} (preset {cfg.model.preset or '-'}, path "
                     f"{cfg.model.path or r.model.default_path or '-'})",
            "algorithm": r.algorithm.qualified_name,
            "rollout_engine": r.rollout_engine.qualified_name,
            "train_engine": r.train_engine.qualified_name,
            "rewards": [f"{e.name} x{e.weight}{'' if e.required else ' (optional)'}" for e in cfg.rewards],
            "device": cfg.run.device,
            "executor": cfg.run.executor,
            "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "steps": cfg.run.steps,
            "data": self.data.summary() if self.data is not None else "none (set data.prompts)",
            "trackers": [t.name for t in cfg.run.trackers],
            "eval_every": cfg.run.eval_every,
            "config": self.dump,
        }

    def claim(self, manager: PluginManager) -> bool:
        """Take the run directory (locked for this process): True when it resumes a run saved there."""
        return RunDir(self.run_path).claim(self.dump, self.resolved.lock(manager))
