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
