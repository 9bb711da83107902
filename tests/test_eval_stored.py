"""``omnirl eval`` of a checkpoint whose workers' files are in ``run.storage`` (issue 32): the weights are fetched from
the storage, each file checked against its SHA-256, and the model samples exactly as with the same weights given as
a LoRA directory; a damaged stored file is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omnirl_core.loop.evaluation import Evaluator, eval_requests
from omnirl_core.rundir.checkpoint import save_checkpoint, stored_name
from omnirl_core.rundir.storage import (
    STORAGE_FILE,
    STORED_MANIFEST,
    Storage,
    StorageError,
    record,
    stored_manifest,
)


def _resolve(manager, tmp_path: Path):
    from omnirl_core.resolve import resolve_run

    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                          "omnirl_plugin_diffusers", "omnirl_plugin_torch", "omnirl_plugin_color"])
    return resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
        "rewards": [{"name": "color"}], "rollout": {"num_steps": 2, "height": 32, "width": 32},
        "run": {"device": "cpu", "output_dir": str(tmp_path / "run")}}], probe_device=False)


def _stored(run: Path, weights: Path, location: Path) -> Path:
    """A checkpoint written as the Ray executor writes one with ``run.storage``: the weights' files in the storage,
    only the record (``storage.json``) and the controller's files in the run directory."""
    def write_state(directory: Path) -> list[str]:
        storage, target = Storage(str(location)), f"checkpoints/{stored_name(directory)}"
        files = {p.name: storage.put(p, target, p.name) for p in sorted(weights.iterdir())}
        storage.write_bytes(stored_manifest(files), target, STORED_MANIFEST)
        (directory / STORAGE_FILE).write_text(json.dumps(record(str(location), target, files)))
        return sorted(files)

    return save_checkpoint(run, 1, write_state, {}, b'{"step": 1}\n')


def test_a_stored_checkpoint_evaluates_as_its_weights_do(manager, tmp_path: Path):
    resolved = _resolve(manager, tmp_path)
    evaluator = Evaluator(resolved, score=False)
    model = evaluator.worker.model
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i), dtype=v.dtype)
               for i, (k, v) in enumerate(model.trained_state_dict().items())}
    lora = tmp_path / "lora"
    model.save_trained(lora, trained)
    checkpoint = _stored(tmp_path / "run", lora, tmp_path / "storage")
    assert not any(p.suffix == ".safetensors" for p in checkpoint.rglob("*"))  # the weights are only in the storage

    request = eval_requests([{"prompt": "a red square"}], resolved.config, 1, 3)
    base = evaluator.generate(request, score=False)[0].output
    evaluator.load(checkpoint)
    stored = evaluator.generate(request, score=False)[0].output
    evaluator.load(lora)
    direct = evaluator.generate(request, score=False)[0].output
    assert torch.equal(stored, direct) and not torch.equal(stored, base)
    assert evaluator.loaded == str(lora)

    [name] = [p.name for p in lora.iterdir() if p.suffix == ".safetensors"]
    entry = json.loads((checkpoint / STORAGE_FILE).read_text())
    damaged = tmp_path / "storage" / entry["directory"] / name
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(StorageError) as info:
        evaluator.load(checkpoint)
    assert name in info.value.render()
