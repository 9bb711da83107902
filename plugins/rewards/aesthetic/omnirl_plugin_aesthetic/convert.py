"""One-time conversion of the released aesthetic head (.pth, a pickle) to safetensors.

    python -m omnirl_plugin_aesthetic.convert sac+logos+ava1-l14-linearMSE.pth aesthetic-mlp.safetensors

``torch.load(..., weights_only=True)`` reads only tensors and plain containers (no code runs); the keys are
checked against the released layout before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def convert(source: str | Path, target: str | Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from omnirl_plugin_aesthetic.mlp import check_state_dict

    state = torch.load(str(source), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    check_state_dict(state, str(source))
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the released .pth state dict")
    parser.add_argument("target", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    print(convert(args.source, args.target))


if __name__ == "__main__":
    main()
