"""What every diffusers-style flow model plugin shares: LoRA through peft, the frozen reference, and
saving weights in the ecosystem's own layout. A model plugin subclasses ``DenoiserModel`` and writes only
its architecture-specific parts (encode, latent shape, schedule, velocity, decode)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from omnirl_core.config import LoraConfig
from omnirl_core.runtime.weight_sync import cpu_copy


class DenoiserModel:
    """Base class: ``self.denoiser`` is the trained network, ``self.pipeline`` the diffusers pipeline."""

    capabilities: frozenset[str] = frozenset()
    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: Any, denoiser: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.pipeline = pipeline
        self.denoiser = denoiser
        self.device = device
        self.dtype = dtype
        self.lora: LoraConfig | None = None
        self._reference_copy: torch.nn.Module | None = None
        self._in_reference = False

    # -- training setup ------------------------------------------------------------------------
    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        """Freeze everything, then make trainable either a fresh LoRA adapter or the whole denoiser."""
        for module in self.frozen_modules():
            module.requires_grad_(False)
        self.denoiser.requires_grad_(False)
        if lora.enabled:
            from peft import LoraConfig as PeftLoraConfig

            targets = lora.target_modules or list(self.default_lora_targets)
            self.denoiser.add_adapter(
                PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, init_lora_weights=True)
            )
            self.lora = lora
        else:
            self.denoiser.requires_grad_(True)
            if need_reference:
                self._reference_copy = copy.deepcopy(self.denoiser).requires_grad_(False).eval()
        self.denoiser.train()

    lockstep = False
    """Set by a sharded train engine when the model trains several modules: every call must then run each
    trained module (a rank with no input for one still joins its collectives), as the ranks must agree."""

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """The modules training updates, by name (a sharded engine wraps each); one denoiser by default, a
        model with several (Wan2.2 A14B's two experts) names them all."""
        return {"denoiser": self.denoiser}

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Modules never trained (text encoders, VAE)."""
        return []

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen reference policy: the base model (LoRA disabled, or a copy made before training)."""
        if self.lora is not None:
            self.denoiser.disable_adapters()
            try:
                yield
            finally:
                self.denoiser.enable_adapters()
        elif self._reference_copy is not None:
            trained, self.denoiser = self.denoiser, self._reference_copy
            try:
                yield
            finally:
                self.denoiser = trained
        else:
            raise RuntimeError("no reference policy: call setup_training(need_reference=True) first")

    # -- weights -------------------------------------------------------------------------------
    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: the LoRA state (peft names) or the full denoiser state."""
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            return {k: cpu_copy(v) for k, v in get_peft_model_state_dict(self.denoiser).items()}
        return {k: cpu_copy(v) for k, v in self.denoiser.state_dict().items()}

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.denoiser, state)
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise ValueError(f"LoRA state has unexpected keys: {unexpected[:5]}")
        else:
            self.denoiser.load_state_dict(state)

    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Write the trained weights in the layout diffusers reads back; returns the files written.

        LoRA: ``pytorch_lora_weights.safetensors`` for ``pipeline.load_lora_weights(directory)``.
        Full: ``<denoiser>/`` via ``save_pretrained`` (safetensors), for ``from_pretrained``.
        ``state``: the full trained state to write instead of the module's own (a sharded trainer gathers
        it first, as ``trained_state_dict`` would return it).
        """
        directory.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            layers = state if state is not None else get_peft_model_state_dict(self.denoiser)
            type(self.pipeline).save_lora_weights(
                save_directory=str(directory), transformer_lora_layers=layers, safe_serialization=True
            )
            return ["pytorch_lora_weights.safetensors"]
        if state is not None:
            from safetensors.torch import save_file

            (directory / "transformer").mkdir(exist_ok=True)
            self.denoiser.save_config(str(directory / "transformer"))
            save_file(state, str(directory / "transformer" / "diffusion_pytorch_model.safetensors"))
            return ["transformer/"]
        self.denoiser.save_pretrained(str(directory / "transformer"), safe_serialization=True)
        return ["transformer/"]

    def load_trained(self, directory: Path) -> None:
        """Load what ``save_trained`` wrote (resume)."""
        from safetensors.torch import load_file

        if self.lora is not None:
            state = load_file(str(directory / "pytorch_lora_weights.safetensors"))
            prefix = "transformer."
            self.load_trained_state_dict({k.removeprefix(prefix): v
                                          for k, v in state.items()})
        else:
            weights = sorted((directory / "transformer").glob("*.safetensors"))
            state = {}
            for file in weights:
                state.update(load_file(str(file)))
            self.load_trained_state_dict(state)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` names -> torch dtypes."""


def load_diffusers_pipeline(pipeline_cls: Any, path: str, dtype: torch.dtype, label: str, access_note: str = "",
                            **kwargs: Any) -> Any:
    """``pipeline_cls.from_pretrained(path)`` for a local diffusers directory or a hub id, with a clear error
    when it is neither (no ``model_index.json`` there, or the hub unreachable / without it). ``label`` names
    the model in messages, ``access_note`` adds how to get the checkpoint (e.g. a gated licence); ``kwargs``
    go to ``from_pretrained`` (e.g. a component set to None)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from omnirl_core.errors import UsageError

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    local = Path(path).expanduser()
    looks_local = local.exists() or path.startswith((".", "/", "~"))
    if looks_local and not (local / "model_index.json").is_file():
        raise UsageError(
            f"'{path}' is not a diffusers {label} directory (no model_index.json).",
            hint="Point model.path at a directory saved with save_pretrained, or use --preset tiny.",
        )
    try:
        return pipeline_cls.from_pretrained(str(local) if looks_local else path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"Could not load {label} from '{path}': it is not a local directory and the hub is unreachable or "
            f"does not have it.{' ' + access_note if access_note else ''}",
            details=[f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"],
            hint="Download the checkpoint to a directory and pass --set model.path=DIR, or use --preset tiny.",
        ) from exc
