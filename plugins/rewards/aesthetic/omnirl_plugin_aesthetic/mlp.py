"""The LAION aesthetic predictor v2 head (christophschuhmann/improved-aesthetic-predictor): an MLP on the
L2-normalised CLIP ViT-L/14 image embedding, with the released layout and state-dict keys (``layers.N``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from omnirl_core.errors import UsageError

LINEAR_KEYS = ("layers.0", "layers.2", "layers.4", "layers.6", "layers.7")
CONVERT = "python -m omnirl_plugin_aesthetic.convert sac+logos+ava1-l14-linearMSE.pth aesthetic-mlp.safetensors"


class AestheticMLP(nn.Module):
    """Linear(d, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64), Dropout(0.1),
    Linear(64, 16), Linear(16, 1): no activations, as released (simple_inference.py)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


def check_state_dict(state: dict[str, torch.Tensor], source: str) -> int:
    """The input size of a head state dict; raises when its keys are not the released layout's."""
    expected = {f"{k}.{p}" for k in LINEAR_KEYS for p in ("weight", "bias")}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise UsageError(
            f"'{source}' is not an aesthetic predictor head.",
            details=([f"missing keys: {missing}"] if missing else []) + ([f"unexpected keys: {extra[:8]}"] if extra else []),
            hint="Use the released sac+logos+ava1-l14-linearMSE.pth, converted with: " + CONVERT,
        )
    return int(state["layers.0.weight"].shape[1])


def load_mlp(path: str | None) -> AestheticMLP:
    """The head from a safetensors file (never a pickle)."""
    from safetensors.torch import load_file

    if path is None:
        raise UsageError(
            "The aesthetic reward needs the predictor head: rewards.<i>.options.mlp_path is not set.",
            details=[("Download sac+logos+ava1-l14-linearMSE.pth from github.com/christophschuhmann/"
                      "improved-aesthetic-predictor and convert it once to safetensors:"), "  " + CONVERT],
            hint="Then set rewards.<i>.options.mlp_path=aesthetic-mlp.safetensors (or use preset=tiny).",
        )
    file = Path(path).expanduser()
    if not file.is_file() or file.suffix != ".safetensors":
        raise UsageError(
            f"Aesthetic predictor head: {file} is missing or not a .safetensors file.",
            details=["Only safetensors are read (a .pth is a pickle). Convert the released file once with:",
                     "  " + CONVERT],
            hint=f"Put the converted file at {file}, or point rewards.<i>.options.mlp_path at it.",
        )
    state = load_file(str(file))
    mlp = AestheticMLP(check_state_dict(state, str(file)))
    mlp.load_state_dict(state)
    return mlp.eval().requires_grad_(False)
