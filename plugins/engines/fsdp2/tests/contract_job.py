"""One rank of the train-engine contract suite on FSDP2 (run as a script; torchrun-style RANK / WORLD_SIZE / MASTER_*
variables, or none for a group of one): ``check_train_engine`` on the core's toy flow model, every rank with the
same rollouts and one shared checkpoint directory. Prints the first update's loss."""

from __future__ import annotations

import sys

import torch
from omnirl_plugin_fsdp2.engine import FSDP2TrainEngine

from omnirl_core.testing.engines import check_train_engine


def main() -> None:
    torch.set_num_threads(1)
    metrics = check_train_engine(lambda model, train: FSDP2TrainEngine(model, train, None, "cpu"),
                                 directory=sys.argv[1])
    print(f"loss {metrics['loss']!r}")


if __name__ == "__main__":
    main()
