"""The memory check a run makes before anything loads (``check_run_memory``: ``--dry-run`` and the run alike),
and its floor: what one step's rollout keeps in host memory until the update.

The floor (``check_rollout_memory``), not a plan: every sample holds its decoded output (3 x H x W [x F] fp32) and
its trajectory ((num_steps + 1) latents, taken as 16 channels at 1/8 resolution, the layout of Qwen-Image, SD3.5 and
FLUX; video VAEs compress more). Model weights, activations and the text encoder come on top of it, so a run
refused here could never fit; one that passes may still need more. It stands in when the model cannot be planned.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from omnirl_core.errors import ConfigError

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig
    from omnirl_core.planning.model import ModelSizing
    from omnirl_core.planning.planner import MemoryPlan
    from omnirl_core.resolve import ResolvedRun

GIB = 1024**3


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_rollout_memory(cfg: RunConfig, available: int | None = None) -> dict[str, int]:
    """Refuse a step whose rollout state alone exceeds the host memory available now."""
    from omnirl_core.planning.planner import rollout_state_bytes

    need = rollout_state_bytes(cfg)
    available = available_host_bytes() if available is None else available
    if available is not None and need["total"] > 0.9 * available:
        r = cfg.rollout
        raise ConfigError(
            f"One step's rollout would hold about {need['total'] / GIB:.1f} GiB in memory, more than the "
            f"{available / GIB:.1f} GiB available here.",
            details=[f"  {need['samples']} samples (rollout.prompts_per_step {r.prompts_per_step} x group_size "
                     f"{r.group_size}) at {r.height}x{r.width}" + (f"x{r.num_frames} frames" if r.num_frames else "")
                     + f": decoded outputs {need['outputs'] / GIB:.1f} GiB, trajectories ({r.num_steps + 1} "
                     f"latents each) {need['trajectories'] / GIB:.1f} GiB; weights and activations come on top."],
            hint="Lower rollout.group_size, rollout.prompts_per_step, the resolution or rollout.num_steps.",
        )
    return need


def device_memory(torch_device: str | None) -> tuple[int | None, str]:
    """(bytes, where from) of the memory a run on ``torch_device`` has: on the CPU the host memory available now
    (what other processes leave), on CUDA the first GPU's total; (None, "") when unknown (no verdict)."""
    if torch_device == "cpu":
        return available_host_bytes(), "of RAM available now"
    if torch_device == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                return int(props.total_memory), f"of cuda:0 ({props.name})"
        except Exception:  # noqa: BLE001 - a failed probe only means no verdict
            return None, ""
    return None, ""


def with_device_dtype(resolved: ResolvedRun, torch_device: str | None) -> ResolvedRun:
    """``resolved`` with ``model.dtype: auto`` made what a run on ``torch_device`` loads (as resolution does for a
    run; a dry run resolves no device), so that the plan counts the weights the run will hold."""
    if torch_device is None or resolved.config.model.dtype != "auto":
        return resolved
    import copy

    from omnirl_core.precision import concrete_dtype

    out = copy.copy(resolved)
    out.config = resolved.config.model_copy(deep=True)
    out.config.model.dtype = concrete_dtype("auto", torch_device)  # type: ignore[assignment]  # a Literal's value
    return out


def local_checkpoint_numel(path: str) -> int | None:
    """Elements of the tensors in the safetensors files under a local checkpoint directory, read from their
    headers (no weights load); None when ``path`` is not a local directory or holds no safetensors file."""
    import json
    import math
    from pathlib import Path

    root = Path(path).expanduser()
    if not root.is_dir():
        return None
    total, found = 0, False
    for file in root.rglob("*.safetensors"):
        try:
            with open(file, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        except (OSError, ValueError):
            return None
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        found = True
    return total if found else None


def _plans_the_checkpoint(path: str | None, sizing: ModelSizing) -> bool:
    """Whether the sizing (the released architecture) describes the checkpoint ``model.path`` names: a hub id is
    taken for one; a local path that is missing is left to the load, which says so; a local directory must hold
    about as many weights (within 2x) as the released model, else it is another model (a tiny one saved to disk)."""
    from pathlib import Path

    if not path or sizing.preset is not None:
        return True
    local = Path(path).expanduser()
    if path.startswith((".", "/", "~")) and not local.exists():
        return False
    numel = local_checkpoint_numel(path)
    planned = sum(sizing.components.values())
    if numel is None or planned <= 0 or 0.5 <= numel / planned <= 2:
        return True
    logging.getLogger("omnirl").info(
        "model.path %s holds %.3g parameters, the released architecture %.3g: the memory plan is not of this "
        "checkpoint, only the floor of a step's samples is checked", path, numel, planned)
    return False


def check_run_memory(resolved: ResolvedRun, torch_device: str | None) -> MemoryPlan | None:
    """The memory check of a run before anything loads, the same for ``--dry-run`` and the real run: the memory
    plan (``omnirl plan``'s numbers for the architecture the run loads) against the memory of the device in use
    (on the CPU, the host memory available now, which holds the step's samples too); refused (``ConfigError``, exit
    2) with the numbers and the changes that would fit. When the model cannot be planned (no ``sizing``, or only
    its released architecture while the run loads a preset), the floor of ``check_rollout_memory`` stands in.
    Returns the plan, or None when there is none."""
    from omnirl_core.errors import OmnirlError
    from omnirl_core.planning.planner import (
        auto_micro_batch,
        check_fits,
        load_sizing,
        plan_memory,
        train_micro_batch,
    )

    run = resolved
    resolved = with_device_dtype(resolved, torch_device)
    cfg = resolved.config
    sizing = None
    if resolved.model.sizing:
        try:
            sizing = load_sizing(resolved)
        except OmnirlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's planner that fails must not stop a run: the floor stands
            logging.getLogger("omnirl").warning("no memory plan for %s (%s: %s); checking the floor only",
                                                resolved.model.name, type(exc).__name__, exc)
    if sizing is None or sizing.preset != cfg.model.preset or not _plans_the_checkpoint(cfg.model.path, sizing):
        check_rollout_memory(cfg)
        return None
    memory, source = device_memory(torch_device)
    micro = auto_micro_batch(resolved, sizing, memory, torch_device)
    if micro is not None and micro < train_micro_batch(cfg):  # auto, and the whole share would not fit: as many as do
        logging.getLogger("omnirl").info("train.micro_batch_size auto: %d transitions per call (the memory plan on %s)", micro, torch_device)
        for config in {id(c): c for c in (run.config, cfg)}.values():
            config.train.micro_batch_size = micro
    plan = plan_memory(resolved, memory, sizing, device_type=torch_device, memory_source=source)
    check_fits(plan, f"The run ({resolved.model.name}, {resolved.algorithm.name}"
               f"{', preset ' + cfg.model.preset if cfg.model.preset else ''}) on {torch_device}")
    if torch_device != "cpu":
        check_rollout_memory(cfg)  # the samples wait in host memory
    return plan
