"""The thinker's two module layouts (see ``model.py``): nested (this environment's transformers) and flat
(transformers 5.9, the veomni environment's). The names map onto each other and onto the checkpoint files; in the
flat layout the tiny preset loads, scores like the thinker's own forward, trains LoRA on the same modules and names
its trained weights as the nested layout does (run in the veomni environment when it is built)."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirl_plugin_qwen3_omni.model import Qwen3OmniOptions, create_model, flat_name, nested_name
from omnirl_plugin_qwen3_omni.tiny import save_tiny

from omnirl_core.config import ModelSection


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen3-omni-tiny"), seed=5)


def test_names_map_between_the_layouts_and_onto_the_checkpoint_files(tiny_dir: Path):
    """Every parameter's flat name is its name in the saved file (transformers writes the released names from
    either layout; the fused experts one expert at a time), and nested_name undoes flat_name."""
    from safetensors import safe_open

    model = create_model(ModelSection(name="qwen3-omni", preset="tiny", path=str(tiny_dir)), Qwen3OmniOptions(), "cpu")
    assert not model.flat  # this environment's transformers
    names = list(model.module.state_dict())
    assert any(n.startswith("model.language_model.layers.") for n in names)
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as saved:
        files = set(saved.keys())
    flat = {flat_name(n) for n in names}
    # the fused expert tensors are written one expert at a time (model.layers.0.mlp.experts.3.up_proj.weight)
    assert {n for n in flat if ".experts." not in n} == {k for k in files if ".experts." not in k}
    assert {n.split(".experts.")[0] for n in flat if ".experts." in n} == {k.split(".experts.")[0] for k in files
                                                                           if ".experts." in k}
    assert all(nested_name(flat_name(n)) == n for n in names)
    assert nested_name("lm_head.weight") == "lm_head.weight" and flat_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.engines
def test_the_flat_layout_scores_trains_and_names_like_the_nested_one(tiny_dir: Path, tmp_path: Path):
    """The same script in this environment and in the veomni one (transformers 5.9): same LoRA targets, same trained
    names, the trainer's scoring equal to the thinker's own forward in both, and the same log-probs for a text and an
    audio prompt across the two transformers."""
    from omnirl_core.serving.envs import component_environment, environment_python
    from omnirl_core.testing import require_engine_environment

    require_engine_environment("veomni", "cpu")
    python = str(environment_python(component_environment("veomni", "cpu")))
    audio = tmp_path / "tone.wav"
    with wave.open(str(audio), "wb") as wav:  # 0.7 s at 8 kHz, 16-bit
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(8000)
        wav.writeframes((np.sin(2 * np.pi * 440 * np.arange(5600) / 8000) * 12000).astype(np.int16).tobytes())
    job = Path(__file__).with_name("flat_layout_job.py")
    found = {}
    for name, interpreter in (("nested", sys.executable), ("flat", python)):
        args = [interpreter, str(job), "--preset", str(tiny_dir), "--audio", str(audio), "--out", str(tmp_path / name)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    nested, flat = found["nested"], found["flat"]
    assert not nested["flat"] and flat["flat"], (nested["transformers"], flat["transformers"])
    assert flat["targets"] == [flat_name(t) for t in nested["targets"]] and len(nested["targets"]) == 8
    assert flat["called"] == ["Linear"] and nested["called"] == ["Qwen3OmniMoeThinkerModel", "Linear"]
    for key in ("state", "grads", "adapter_targets"):  # nested names in both
        assert flat[key] == nested[key] and all(k.startswith("model.language_model.layers.") for k in flat[key]), key
    assert nested["scored_vs_forward"] < 1e-5 and flat["scored_vs_forward"] < 1e-5
    diff = max(abs(a - b) for x, y in zip(nested["scored"], flat["scored"]) for a, b in zip(x, y))
    assert diff < 1e-5, diff
    assert torch.tensor(flat["scored"]).isfinite().all()
