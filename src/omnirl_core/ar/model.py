"""The causal-LM base of autoregressive (AR / omni) model plugins.

A model plugin subclasses ``CausalLMPolicy`` and writes only what is model-specific: turning a request into a
``TokenPrompt`` (chat template, media features) and batching media features (``media_inputs``). The token
distribution itself lives in ``omnirl_core.ar.sampling``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from omnirl_core.ar.sampling import SamplingParams, TokenPrompt, pad_sequences, sampling_logprobs
from omnirl_core.config import LoraConfig
from omnirl_core.contracts import GenRequest
from omnirl_core.contracts.model import TokenModel
from omnirl_core.lora import adapters_disabled
from omnirl_core.weights import cpu_copy

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS_DIR = "model"


class CausalLMPolicy(TokenModel):
    """Base class of AR model plugins around a transformers causal LM (``self.module``, with ``generate``).

    Subclasses set ``capabilities`` and ``default_lora_targets`` (a regex over module names) and implement
    ``encode_prompt`` and ``media_inputs``.
    """

    capabilities: frozenset[str] = frozenset({"ar-text", "text", "lora"})
    default_lora_targets: str = r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"

    def __init__(self, module: torch.nn.Module, tokenizer: Any, device: torch.device, dtype: torch.dtype):
        self.module = module
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.lora: LoraConfig | None = None
        self._reference_copy: torch.nn.Module | None = None
        self._peft_config: Any = None

    # -- model-specific ------------------------------------------------------------------------
    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        """Token ids of the request's prompt (chat template, generation prompt) with its media features."""
        raise NotImplementedError

    def media_inputs(self, media: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Model keyword arguments for the media of a batch of rows (row order kept)."""
        raise NotImplementedError

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        return {"module": self.module}

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Modules never trained, even in full fine-tuning (e.g. the vision and audio encoders)."""
        return []

    def called_submodules(self) -> list[torch.nn.Module]:
        """The decoder and the output head: scoring calls them by themselves (``hidden_states``, ``output_logits``)."""
        return [self.module.base_model, self.module.get_output_embeddings()]  # type: ignore[operator, list-item]

    # -- tokens --------------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (int(self.tokenizer.eos_token_id),)

    def token_id(self, text: str) -> int:
        """The id of a token given as text; it must be exactly one token."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens ({ids}), not one; give single tokens")
        return int(ids[0])

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def model_inputs(self, seqs: Sequence[torch.Tensor], media: Sequence[dict[str, torch.Tensor]],
                     side: str) -> dict[str, torch.Tensor]:
        ids, mask = pad_sequences(seqs, self.pad_token_id, side)
        inputs = {"input_ids": ids, "attention_mask": mask, **self.media_inputs(media)}
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

    # -- scoring -------------------------------------------------------------------------------
    def hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Last hidden states (B, L, H) of the decoder; logits are then taken only where they are needed."""
        return self.module.base_model(**inputs, use_cache=False)[0]  # type: ignore[operator]  # transformers' model

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (N, V) of hidden states (N, H): the output head. ``hidden_states`` and this are
        the two calls scoring makes, so a train engine that runs the decoder itself (megatron's) overrides both."""
        return self.module.get_output_embeddings()(hidden)  # type: ignore[operator]  # transformers' model

    def token_logprobs(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                       params: Sequence[SamplingParams]) -> list[torch.Tensor]:
        """Log-probs of the given completion tokens under the current weights and each row's sampling
        distribution (with grad when grad is enabled); one (T_i,) fp32 tensor per row."""
        return self.token_logprobs_under(prompts, completions, [params])[0]

    def token_logprobs_under(self, prompts: Sequence[TokenPrompt], completions: Sequence[torch.Tensor],
                             distributions: Sequence[Sequence[SamplingParams]]) -> list[list[torch.Tensor]]:
        """``token_logprobs`` under several distributions from one forward pass: ``distributions[k]`` holds each
        row's ``SamplingParams``; returns one list of (T_i,) fp32 tensors per entry (e.g. the sampling
        distribution for a ratio and the same one without its top-k / top-p cut for a KL term)."""
        seqs = [torch.cat([p.input_ids, c.to(p.input_ids.device)]) for p, c in zip(prompts, completions)]
        hidden = self.hidden_states(self.model_inputs(seqs, [p.media for p in prompts], side="right"))
        rows, cols = [], []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            start = len(p.input_ids) - 1  # the state before token t predicts token t
            rows += [i] * len(c)
            cols += list(range(start, start + len(c)))
        h = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(cols, device=hidden.device)]
        logits = self.output_logits(h)
        tokens = torch.cat([c for c in completions]).to(logits.device)
        results = []
        for params in distributions:
            row_params = [params[i] for i in rows]
            out = torch.empty(len(tokens), dtype=torch.float32, device=logits.device)
            for sp in dict.fromkeys(row_params):  # one pass per distinct sampling distribution (usually one)
                idx = torch.tensor([j for j, q in enumerate(row_params) if q == sp], device=logits.device)
                logp = sampling_logprobs(logits.index_select(0, idx), sp)
                out = out.index_put((idx,), logp.gather(-1, tokens[idx][:, None])[:, 0])
            results.append(list(out.split([len(c) for c in completions])))
        return results

    # -- training setup ------------------------------------------------------------------------
    def lora_target_names(self, patterns: Sequence[str] | None) -> list[str]:
        """Full names of the linear modules to adapt: ``patterns`` (regexes matched against the whole module
        name, or plain suffixes) or the plugin's default. Explicit names keep peft from widening a regex
        (its MoE conversion turns one into bare suffixes, which would also hit the audio/vision towers)."""
        regexes = [re.compile(p) for p in (patterns or [self.default_lora_targets])]
        names = []
        for name, module in self.module.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if any(r.fullmatch(name) or name.endswith("." + r.pattern) for r in regexes):
                names.append(name)
        if not names:
            raise ValueError(f"no linear module matches the LoRA targets {patterns or [self.default_lora_targets]}")
        return names

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        """Freeze everything, then make trainable a fresh LoRA adapter or the whole model (minus
        ``frozen_modules``)."""
        self.module.requires_grad_(False)
        if lora.enabled:
            from peft import LoraConfig as PeftLoraConfig
            from peft import inject_adapter_in_model

            self._peft_config = PeftLoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, target_modules=self.lora_target_names(lora.target_modules),
                init_lora_weights=lora.peft_init,
            )
            inject_adapter_in_model(self._peft_config, self.module, adapter_name="default")
            self.lora = lora
        else:
            self.module.requires_grad_(True)
            for module in self.frozen_modules():
                module.requires_grad_(False)
            if need_reference:
                self._reference_copy = copy.deepcopy(self.module).requires_grad_(False).eval()
        # eval mode: no dropout, so that rollout, recompute and update see one deterministic policy
        self.module.eval()

    @property
    def recomputes_activations(self) -> bool:
        """Whether the run asked this policy to recompute its decoder's activations in the backward
        (``model.options.gradient_checkpointing``): a train engine that runs the decoder itself (megatron's) honours it
        its own way. False unless the model plugin says so."""
        return False

    @property
    def has_reference_copy(self) -> bool:
        """Whether a frozen copy of the weights made before training is kept (full fine-tuning with a reference)."""
        return self._reference_copy is not None

    def drop_reference_copy(self) -> None:
        """Free that copy: a train engine that scores the reference with weights of its own (megatron's shards)."""
        self._reference_copy = None

    def move_to(self, device: torch.device | str) -> None:
        """Move the module (and the reference copy) to ``device``. ``self.device``, where inputs are put, stays:
        a train engine that scores with its own copy of the weights keeps this one in host memory."""
        self.module.to(device)
        if self._reference_copy is not None:
            self._reference_copy.to(device)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen reference policy: the base model (LoRA disabled, or a copy made before training)."""
        if self.lora is not None:
            with adapters_disabled(self.module):
                yield
        elif self._reference_copy is not None:
            trained, self.module = self.module, self._reference_copy
            try:
                yield
            finally:
                self.module = trained
        else:
            raise RuntimeError("no reference policy: call setup_training(need_reference=True) first")

    # -- weights -------------------------------------------------------------------------------
    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights: the LoRA state (peft names) or the full model state."""
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.module, adapter_name="default")
        else:
            state = self.module.state_dict()
        return {k: cpu_copy(v) for k, v in state.items()}

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.module, state, adapter_name="default")
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise ValueError(f"LoRA state has unexpected keys: {unexpected[:5]}")
        else:
            self.module.load_state_dict(state)

    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """LoRA: the peft adapter layout (``adapter_model.safetensors`` + ``adapter_config.json``), which
        ``PeftModel.from_pretrained(base, directory)`` reads. Full: ``model/`` via ``save_pretrained``.
        ``state``: the trained state to write instead of the module's own (a sharded trainer gathers it)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in state.items()} if state is not None else None
        if self.lora is not None:
            save_file(state if state is not None else self.trained_state_dict(), str(directory / ADAPTER_WEIGHTS))
            config = self._peft_config.to_dict()
            config["base_model_name_or_path"] = getattr(self.module, "name_or_path", None)
            (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=sorted))
            return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        self.module.save_pretrained(  # type: ignore[operator]  # transformers' PreTrainedModel
            str(directory / FULL_WEIGHTS_DIR), safe_serialization=True, state_dict=state)
        return [f"{FULL_WEIGHTS_DIR}/"]

    def load_trained(self, directory: Path) -> None:
        """Load what ``save_trained`` wrote (resume)."""
        from safetensors.torch import load_file

        if self.lora is not None:
            self.load_trained_state_dict(load_file(str(directory / ADAPTER_WEIGHTS)))
            return
        # from_pretrained undoes the checkpoint's key renaming (transformers saves some models under other names)
        saved = type(self.module).from_pretrained(  # type: ignore[attr-defined]  # transformers' PreTrainedModel
            str(directory / FULL_WEIGHTS_DIR), dtype=self.dtype)
        self.module.load_state_dict(saved.state_dict())
