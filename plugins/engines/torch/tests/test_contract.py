"""The core's train-engine contract suite (``omnirl_core.testing.engines.check_train_engine``) on the
single-process torch engine: LoRA and full fine-tuning of the core's toy flow model."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnirl_plugin_torch.engine import TorchTrainEngine, TorchTrainOptions

from omnirl_core.testing.engines import check_train_engine, toy_flow_model


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_train_engine_contract(tmp_path: Path, lora: bool):
    metrics = check_train_engine(lambda model, train: TorchTrainEngine(model, train, TorchTrainOptions(), "cpu"),
                                 lambda: toy_flow_model(lora=lora), directory=tmp_path)
    assert metrics["train/skipped_minibatches"] == 0.0
    expected = "pytorch_lora_weights.safetensors" if lora else "transformer/diffusion_pytorch_model.safetensors"
    assert (tmp_path / expected).is_file() and (tmp_path / "optimizer.safetensors").is_file()
