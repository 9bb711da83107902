"""torch.distributed process groups for training worker groups (gloo on CPU, nccl on CUDA, hccl on
Ascend: the hardware plugin's ``DeviceSpec.backend``), and the blocks a sharding engine shards one by one."""

from __future__ import annotations

import atexit
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def default_backend(device_type: str) -> str:
    """The backend torch pairs with a device type (a device extension such as torch-npu adds its own)."""
    import torch.distributed as dist

    return dist.Backend.default_device_backend_map.get(device_type, "gloo")


def init_process_group(backend: str, rank: int, world_size: int, address: str, port: int,
                       timeout_s: float = 600.0) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(backend=backend, init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    atexit.register(destroy_at_exit)


def destroy_at_exit() -> None:
    """Destroys the process groups while the interpreter is still whole (registered at exit by
    ``init_process_group``). Left to the interpreter's finalisation, gloo's worker threads may still hold work
    objects whose tensors need the interpreter, and the process aborts (SIGABRT, "terminate called without an
    active exception") after its work is done: seen on rank processes of the fsdp2 and veomni tests, exit code -6
    with every output written."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the process is exiting: say it, do not mask its exit code
            sys.stderr.write(f"omnirl: destroying the process group at exit failed: {type(exc).__name__}: {exc}\n")


def ensure_process_group(backend: str) -> None:
    """Join the group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun's variables),
    or form a group of one when they are unset (a single process can run a distributed engine)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_process_group(backend, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                           os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
    else:
        init_process_group(backend, 0, 1, "127.0.0.1", free_port())


def shard_units(module: torch.nn.Module, names: list[str] | None = None) -> list[torch.nn.Module]:
    """The blocks a sharding engine (FSDP2) shards and gathers one at a time: the modules of the ModuleLists
    ``names`` (dotted paths below ``module``); by default those of ``module``'s top-level ModuleLists, else of
    its outermost ModuleLists wherever they sit (a decoder's layers below ``language_model.model``). Empty: no
    repeated blocks (the module is one unit)."""
    import torch

    if names is not None:
        lists = []
        for name in names:
            try:
                found = module.get_submodule(name)
            except AttributeError:
                found = None
            if not isinstance(found, torch.nn.ModuleList):
                from omnirl_core.errors import ConfigError

                raise ConfigError(f"'{name}' is not a ModuleList of {type(module).__name__}.",
                                  hint="shard_modules take the dotted paths of the ModuleLists that hold the blocks "
                                  "(e.g. transformer_blocks, language_model.model.layers).")
            lists.append(found)
        return [block for found in lists for block in found]
    top = [block for _, child in module.named_children() if isinstance(child, torch.nn.ModuleList) for block in child]
    if top:
        return top
    chosen: list[str] = []
    blocks: list[torch.nn.Module] = []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and name and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
            blocks.extend(child)
    return blocks
