"""The FLUX-style autoencoder BAGEL decodes with (``ae.safetensors``), in plain PyTorch with the
checkpoint's own (LDM/BFL) parameter names: ``encoder.*`` / ``decoder.*``, ``down.{i}.block.{j}``,
``mid.block_1``, ``mid.attn_1``, ``up.{i}.upsample``, ``norm_out``, ``conv_out``. The standard LDM
convolutional autoencoder (Rombach et al., arXiv:2112.10752): ResNet blocks with GroupNorm(32), one
single-head attention block in the middle, a diagonal Gaussian posterior, no quant convolutions.

The geometry (channels, multipliers, blocks per level, latent channels) is read from the weights' shapes, so
the same code loads the released autoencoder (128, [1, 2, 4, 4], 2, z 16) and the tiny preset's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnirl_core.errors import UsageError


@dataclass(frozen=True)
class AutoEncoderParams:
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    in_channels: int = 3

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]], where: str) -> AutoEncoderParams:
        """The geometry of an ``ae.safetensors`` from its tensor shapes."""
        try:
            ch = shapes["encoder.conv_in.weight"][0]
            levels = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down."))
            mult = tuple(shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] // ch for i in range(levels))
            blocks = 1 + max(int(k.split(".")[4]) for k in shapes if k.startswith("encoder.down.0.block."))
            z = shapes["decoder.conv_in.weight"][1]
        except (KeyError, ValueError) as exc:
            raise UsageError(f"{where} is not a FLUX/BFL-layout autoencoder (missing {exc}).",
                             hint="Use the ae.safetensors of the BAGEL-7B-MoT release.") from None
        return cls(ch=ch, ch_mult=mult, num_res_blocks=blocks, z_channels=z,
                   in_channels=shapes["encoder.conv_in.weight"][1])


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = _norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, 1x1 convolutions for q, k, v and the output."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = self.norm(x)
        q, k, v = (f(n).reshape(b, 1, c, h * w).transpose(2, 3) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Pad right and bottom by one, then a stride-2 3x3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Mid(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        self.conv_in = nn.Conv2d(p.in_channels, p.ch, 3, padding=1)
        in_mult = (1, *p.ch_mult)
        self.down = nn.ModuleList()
        for i, mult in enumerate(p.ch_mult):
            level = nn.Module()
            block_in, block_out = p.ch * in_mult[i], p.ch * mult
            level.block = nn.ModuleList(
                [ResnetBlock(block_in if j == 0 else block_out, block_out) for j in range(p.num_res_blocks)])
            level.attn = nn.ModuleList()
            if i != len(p.ch_mult) - 1:
                level.downsample = Downsample(block_out)
            self.down.append(level)
        channels = p.ch * p.ch_mult[-1]
        self.mid = _Mid(channels)
        self.norm_out = _norm(channels)
        self.conv_out = nn.Conv2d(channels, 2 * p.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            for block in level.block:
                h = block(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        channels = p.ch * p.ch_mult[-1]
        self.conv_in = nn.Conv2d(p.z_channels, channels, 3, padding=1)
        self.mid = _Mid(channels)
        up = []
        block_in = channels
        for i in reversed(range(len(p.ch_mult))):
            level = nn.Module()
            block_out = p.ch * p.ch_mult[i]
            level.block = nn.ModuleList(
                [ResnetBlock(block_in if j == 0 else block_out, block_out) for j in range(p.num_res_blocks + 1)])
            level.attn = nn.ModuleList()
            if i != 0:
                level.upsample = Upsample(block_out)
            block_in = block_out
            up.insert(0, level)
        self.up = nn.ModuleList(up)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, p.in_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            for block in level.block:
                h = block(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class AutoEncoder(nn.Module):
    """Images in [-1, 1] <-> normalised latents z = scale * (posterior - shift)."""

    def __init__(self, params: AutoEncoderParams, scale_factor: float, shift_factor: float):
        super().__init__()
        self.params = params
        self.scale_factor, self.shift_factor = scale_factor, shift_factor
        self.encoder = Encoder(params)
        self.decoder = Decoder(params)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None, sample: bool = False) -> torch.Tensor:
        """The posterior's mean (``sample=False``: deterministic) or a draw from it, normalised."""
        mean, logvar = self.encoder(x).chunk(2, dim=1)
        z = mean
        if sample:
            noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(mean.device)
            z = mean + torch.exp(0.5 * logvar) * noise
        return self.scale_factor * (z - self.shift_factor)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z / self.scale_factor + self.shift_factor)
