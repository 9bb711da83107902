"""Checkpoints: safetensors only, written atomically (a crash never leaves a half checkpoint as latest).

Layout of ``<run>/checkpoints/step-000020/``:
  pytorch_lora_weights.safetensors | transformer/   trained weights, in the layout diffusers reads
  optimizer.safetensors                             optimizer tensors (flattened)
  trainer_state.json                                step, optimizer param groups, extra state
``<run>/checkpoints/latest`` names the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state into tensors (for safetensors) and JSON-able metadata; no pickle."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                           meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, _, key = name.partition(".")
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, model: Any, optimizer: torch.optim.Optimizer | None,
                    extra: dict[str, Any]) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:06d}-", dir=root))
    try:
        files = model.save_trained(tmp)
        meta: dict[str, Any] = {}
        if optimizer is not None:
            tensors, meta = optimizer_to_tensors(optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {"step": step, "files": files, "optimizer": meta, **extra}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _write_text_atomic(root / "latest", final.name + "\n")
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def load_checkpoint(path: Path, model: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    state = json.loads((path / "trainer_state.json").read_text())
    model.load_trained(path)
    if optimizer is not None and (path / "optimizer.safetensors").is_file():
        optimizer_from_tensors(optimizer, load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    return state
