"""A first, up-front memory check: what one step's rollout keeps in host memory until the update.

A floor, not a plan: every sample holds its decoded output (3 x H x W [x F] fp32) and its trajectory
((num_steps + 1) latents, taken as 16 channels at 1/8 resolution, the layout of Qwen-Image, SD3.5 and FLUX;
video VAEs compress more). Model weights, activations and the text encoder come on top of it, so a run
refused here could never fit; one that passes may still need more.
"""

from __future__ import annotations

from typing import Any

from omnirl_core.errors import ConfigError

GIB = 1024**3


def rollout_state_bytes(cfg: Any) -> dict[str, int]:
    r = cfg.rollout
    samples = r.prompts_per_step * r.group_size
    pixels = r.height * r.width * (r.num_frames or 1)
    outputs = samples * 3 * pixels * 4
    latents = samples * (r.num_steps + 1) * max(pixels // 64, 1) * 16 * 4
    return {"samples": samples, "outputs": outputs, "trajectories": latents, "total": outputs + latents}


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


def check_rollout_memory(cfg: Any, available: int | None = None) -> dict[str, int]:
    """Refuse a step whose rollout state alone exceeds the host memory available now."""
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


def with_device_dtype(resolved: Any, torch_device: str | None) -> Any:
    """``resolved`` with ``model.dtype: auto`` made what a run on ``torch_device`` loads (as resolution does for a
    run; a dry run resolves no device), so that the plan counts the weights the run will hold."""
    if torch_device is None or resolved.config.model.dtype != "auto":
        return resolved
    import copy

    from omnirl_core.precision import concrete_dtype

    out = copy.copy(resolved)
    out.config = resolved.config.model_copy(deep=True)
    out.config.model.dtype = concrete_dtype("auto", torch_device)
    return out


def check_run_memory(resolved: Any, torch_device: str | None) -> Any:
    """The memory check of a run before anything loads, the same for ``--dry-run`` and the real run: the memory
    plan (``omnirl plan``'s numbers for the architecture the run loads) against the memory of the device in use
    (on the CPU, the host memory available now, which holds the step's samples too); refused (``ConfigError``, exit
    2) with the numbers and the changes that would fit. When the model cannot be planned (no ``sizing``, or only
    its released architecture while the run loads a preset), the floor of ``check_rollout_memory`` stands in.
    Returns the plan, or None when there is none."""
    import logging

    from omnirl_core.errors import OmnirlError
    from omnirl_core.plan.planner import check_fits, load_sizing, plan_memory

    resolved = with_device_dtype(resolved, torch_device)
    cfg = resolved.config
    sizing = None
    if getattr(resolved.model, "sizing", None):
        try:
            sizing = load_sizing(resolved)
        except OmnirlError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's planner that fails must not stop a run: the floor stands
            logging.getLogger("omnirl").warning("no memory plan for %s (%s: %s); checking the floor only",
                                                resolved.model.name, type(exc).__name__, exc)
    if sizing is None or sizing.preset != cfg.model.preset:
        check_rollout_memory(cfg)
        return None
    memory, source = device_memory(torch_device)
    plan = plan_memory(resolved, memory, sizing, device_type=torch_device, memory_source=source)
    check_fits(plan, f"The run ({resolved.model.name}, {resolved.algorithm.name}"
               f"{', preset ' + cfg.model.preset if cfg.model.preset else ''}) on {torch_device}")
    if torch_device != "cpu":
        check_rollout_memory(cfg)  # the samples wait in host memory
    return plan
