"""One rank of the train-engine contract suite on the megatron engine (run as a script; torchrun-style RANK /
WORLD_SIZE / MASTER_* variables, or none for a group of one): ``check_train_engine`` on the tiny Qwen3-Omni thinker
(full fine-tuning, a reference for the KL term), tensor parallelism over every rank, one shared checkpoint
directory. The model comes through the plugin registry (plugins never import each other). Prints the first
update's loss."""

from __future__ import annotations

import sys

import torch
from omnirl_plugin_megatron.engine import MegatronTrainEngine

from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.plugins import PluginManager
from omnirl_core.testing.engines import check_train_engine


def build_thinker():
    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_qwen3_omni"])
    factory = manager.resolve("model", "qwen3-omni").load_factory()
    model = factory(ModelSection(name="qwen3-omni", preset="tiny", dtype="float32"), None, "cpu")
    model.setup_training(LoraConfig(enabled=False), need_reference=True)
    return model


def main() -> None:
    torch.set_num_threads(1)
    metrics = check_train_engine(lambda model, train: MegatronTrainEngine(model, train, None, "cpu"), build_thinker,
                                 directory=sys.argv[1], lr=1e-3)
    print(f"loss {metrics['loss']!r}")


if __name__ == "__main__":
    main()
