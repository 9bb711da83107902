"""The Qwen3-Omni thinker (transformers ``Qwen3OmniMoeThinkerForConditionalGeneration``) behind the omnirl
AR contract (``omnirl_core.ar.model.CausalLMPolicy``): prompts with images and audio, LoRA on the text decoder.

Released checkpoints (``Qwen/Qwen3-Omni-30B-A3B-Instruct`` / ``-Thinking`` / ``-Captioner``) hold the whole omni
model (thinker + talker + code2wav). By default only the thinker is loaded and trained (text out); with
``model.options.train=talker`` the whole model is loaded and its talker trained (speech out, ``talker.py``), speaking the
prompt or (``speak=reply``) the thinker's reply generated in the same rollout; ``train=thinker+talker`` trains both.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.ar.sampling import TokenPrompt
from omnirl_core.config import LoraConfig, ModelSection
from omnirl_core.contracts import GenRequest
from omnirl_core.errors import UsageError
from omnirl_core.presets import atomic_directory, cache_dir, checkpoint_path
from omnirl_plugin_qwen3_omni.media import MediaEncoder, collate_media

if TYPE_CHECKING:
    from omnirl_plugin_qwen3_omni.talker import Qwen3OmniTalker

DEFAULT_HUB_ID = "Qwen/Qwen3-Omni-30B-A3B-Instruct"


class Qwen3OmniOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = Field(None, description="A system message put before every prompt (None: none).")
    attn_implementation: str = Field("sdpa", description="transformers attention backend: 'sdpa', 'eager', "
                                     "'flash_attention_2' (GPU, needs flash-attn).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each text decoder layer's activations in the backward pass (much less "
        "training memory for long sequences, about a third more compute; same numbers)."
    )
    train: Literal["thinker", "talker", "thinker+talker"] = Field(
        "thinker", description="What is trained: 'thinker' (text out); 'talker' (speech out: codec frames are the "
        "tokens, code2wav makes the waveform; the thinker frozen; needs a checkpoint with a talker); 'thinker+talker' "
        "(both jointly: the thinker's reply tokens then the talker's frames are one sequence, its log-prob the sum of "
        "both modules', logged per module as logprob/thinker/* and logprob/talker/*)."
    )
    speak: Literal["prompt", "reply"] | None = Field(
        None, description="What the talker speaks: 'prompt' (the prompt is the text spoken: text to speech) or "
        "'reply' (the thinker generates a reply to the prompt in the same rollout and the talker speaks it; "
        "rollout.options.allowed_tokens / stop_tokens then guide the reply). None: 'prompt' with train=talker, "
        "'reply' with train=thinker+talker (which needs it)."
    )
    reply_max_tokens: int = Field(32, ge=1, description="Most tokens of the thinker's reply with speak=reply (its "
                                  "stop token included); rollout.options.max_new_tokens bounds the talker's frames.")
    reply_min_tokens: int = Field(1, ge=0, description="Fewest tokens of the thinker's reply before its stop tokens may "
                                  "be drawn (as transformers' min_new_tokens; 1: never an empty reply, which would "
                                  "give the talker nothing to say).")

    @model_validator(mode="after")
    def _reply_bounds(self) -> Qwen3OmniOptions:
        if self.reply_min_tokens > self.reply_max_tokens:
            raise ValueError(f"reply_min_tokens ({self.reply_min_tokens}) is above reply_max_tokens "
                             f"({self.reply_max_tokens}): lower it, or raise reply_max_tokens")
        return self
    speaker: str = Field("ethan", description="The talker's voice: a name in the checkpoint's talker speaker_id.")
    tiny_seed: int = Field(0, description="Seed of the tiny preset's random weights.")
    tiny_head_dim: int = Field(8, ge=2, description="Attention head size of the tiny preset's text decoder (64 "
                               "for the vllm engine on a CPU, whose attention takes 64 and up).")


# The thinker's two module layouts. Nested (the project's transformers, 5.2x): ``thinker.model`` is a
# ``Qwen3OmniMoeThinkerModel`` holding ``audio_tower``, ``visual`` and the text decoder ``language_model``, and merges the
# media features itself. Flat (transformers 5.9, VeOmni 0.1.12's pin): the towers sit on the thinker beside a text-only
# ``thinker.model`` (``Qwen3OmniMoeThinkerTextModel``), and the thinker's forward merges the media. Same parameters,
# same shapes, same checkpoint files (both save and load the released names: ``model.layers.*``, ``audio_tower.*``,
# ``visual.*``); only the in-memory names differ. The plugin speaks the nested names everywhere (LoRA target patterns,
# ``trained_state_dict``, peft adapter files), whichever layout it runs on.
_FLAT_TO_NESTED = (("model.", "model.language_model."), ("audio_tower.", "model.audio_tower."),
                   ("visual.", "model.visual."))


def nested_name(name: str) -> str:
    """A flat-layout parameter or module name under its nested-layout name (``model.layers.0...`` ->
    ``model.language_model.layers.0...``); other names (``lm_head.weight``) unchanged."""
    for flat, nested in _FLAT_TO_NESTED:
        if name.startswith(flat):
            return nested + name[len(flat):]
    return name


def flat_name(name: str) -> str:
    """The inverse of ``nested_name``."""
    for flat, nested in _FLAT_TO_NESTED:
        if name.startswith(nested):
            return flat + name[len(nested):]
    return name


def is_flat_layout(thinker: torch.nn.Module) -> bool:
    """Whether ``thinker`` (a ``Qwen3OmniMoeThinkerForConditionalGeneration``) has the flat layout (towers beside a
    text-only ``model``: transformers 5.9) rather than the nested one (``model.language_model``)."""
    return "language_model" not in dict(thinker.model.named_children())


class _Decoded(Exception):
    """Carries the text decoder's last hidden states out of the thinker's forward, before its output head."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def _flat_hidden_states(thinker: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    """The decoder's last hidden states of a flat-layout thinker: its own forward (media merging, multimodal rope
    positions), stopped as its text model returns, so the full-vocabulary head never runs. Bound to the thinker as
    ``omnirl_hidden_states`` and named in its ``fsdp_forward_methods``: a sharding engine makes it run the root's
    FSDP hooks, as a call of the thinker would. The hook is added last, after any hook of an engine's."""

    def stop(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        raise _Decoded(output[0])

    handle = thinker.model.register_forward_hook(stop)
    try:
        thinker.forward(**inputs)  # forward, not __call__: the engine's hooks of the root ran for this method
    except _Decoded as decoded:
        return decoded.hidden
    finally:
        handle.remove()
    raise RuntimeError("the thinker's forward never called its text model")


class Qwen3OmniThinker(CausalLMPolicy):
    capabilities = frozenset({"ar-text", "text", "lora", "image-input", "audio-input"})
    # the text decoder's attention (the experts are fused 3-D parameters, not linear modules); nested-layout names,
    # matched against the nested name of each module in either layout
    default_lora_targets = r"model\.language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"

    def __init__(self, module: Any, tokenizer: Any, media: MediaEncoder, options: Qwen3OmniOptions,
                 device: torch.device, dtype: torch.dtype):
        super().__init__(module, tokenizer, device, dtype)
        self.media = media
        self.options = options
        config = module.config
        self.image_token_id = int(config.image_token_id)
        self.audio_token_id = int(config.audio_token_id)
        self.flat = is_flat_layout(module)
        if self.flat:  # the decoder is the thinker's forward minus its head: a method of the root (see hidden_states)
            module.omnirl_hidden_states = types.MethodType(_flat_hidden_states, module)
            module.fsdp_forward_methods = ("omnirl_hidden_states",)

    # -- the two layouts ------------------------------------------------------------------------
    def text_decoder(self) -> torch.nn.Module:
        """The text decoder (embeddings, layers, final norm): ``model.language_model`` (nested) or ``model`` (flat)."""
        return self.module.model if self.flat else self.module.model.language_model

    def frozen_modules(self) -> list[torch.nn.Module]:
        towers = self.module if self.flat else self.module.model
        return [towers.audio_tower, towers.visual]

    def called_submodules(self) -> list[torch.nn.Module]:
        """Nested: the decoder (``model``, media merging included) and the output head, as any causal LM. Flat: the
        output head only; the decoder is the thinker itself through ``omnirl_hidden_states`` (its embeddings live
        in ``model`` but the media merging around them in the thinker's forward, so no submodule of it can be
        called alone), which a sharding engine registers as a forward method of the root (``fsdp_forward_methods``)."""
        if self.flat:
            return [self.module.get_output_embeddings()]
        return super().called_submodules()

    def hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.flat:
            return self.module.omnirl_hidden_states(**inputs, use_cache=False)
        return super().hidden_states(inputs)

    def lora_target_names(self, patterns: Any) -> list[str]:
        """As the base class, with the patterns matched against the nested-layout names in either layout (so that
        the default and user patterns mean the same modules); the names returned are the module's own."""
        if not self.flat:
            return super().lora_target_names(patterns)
        regexes = [re.compile(p) for p in (patterns or [self.default_lora_targets])]
        names = []
        for name, module in self.module.named_modules():
            key = nested_name(name)
            if isinstance(module, torch.nn.Linear) and any(r.fullmatch(key) or key.endswith("." + r.pattern)
                                                           for r in regexes):
                names.append(name)
        if not names:
            raise ValueError(f"no linear module matches the LoRA targets {patterns or [self.default_lora_targets]}")
        return names

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The base class's, under nested-layout names in either layout: weight sync between a flat-layout trainer
        (VeOmni's environment) and a nested-layout rollout worker (the project's), and adapter files, agree."""
        state = super().trained_state_dict()
        return {nested_name(k): v for k, v in state.items()} if self.flat else state

    def load_trained_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_trained_state_dict({flat_name(k): v for k, v in state.items()} if self.flat else state)

    def save_trained(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> list[str]:
        """The base class's files, the same in either layout: a full state goes to ``save_pretrained`` under the
        module's own names (which writes the released names in both); an adapter's config names its target
        modules by their nested-layout names, as its weights are."""
        import json

        if not self.flat:
            return super().save_trained(directory, state)
        if self.lora is None:
            state = {flat_name(k): v for k, v in (state if state is not None else self.trained_state_dict()).items()}
            return super().save_trained(directory, state)
        files = super().save_trained(directory, state if state is not None else self.trained_state_dict())
        config_path = directory / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["target_modules"] = sorted(nested_name(t) for t in config["target_modules"])
        config_path.write_text(json.dumps(config, indent=2))
        return files

    @property
    def recomputes_activations(self) -> bool:
        return bool(self.options.gradient_checkpointing)

    def setup_training(self, lora: LoraConfig, need_reference: bool) -> None:
        super().setup_training(lora, need_reference)
        if self.options.gradient_checkpointing:
            self._enable_gradient_checkpointing()

    def _enable_gradient_checkpointing(self) -> None:
        """transformers' checkpointing of the text decoder layers. Those layers checkpoint only in training mode,
        and the policy is kept in eval mode (no dropout): they are switched to training mode in every call that
        records a graph, which changes nothing else as long as their attention dropout is 0 (it is in the released
        configuration)."""
        dropout = float(getattr(self.module.config.text_config, "attention_dropout", 0.0))
        if dropout > 0:
            raise UsageError(
                f"Gradient checkpointing needs the text decoder in training mode, which would turn on its attention "
                f"dropout ({dropout}) and make the trained policy differ from the one that sampled.",
                hint="Set model.options.gradient_checkpointing=false, or use a checkpoint with attention_dropout 0.",
            )
        kwargs = {"use_reentrant": False}
        if hasattr(self.module, "activation_checkpointing_enable"):  # transformers >= 5
            self.module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # training mode for the calls that record a graph only: transformers 5.9 (the flat layout's) checkpoints in
        # training mode with no grad too, and drops the generation's KV cache there (5.25 checks for grad itself)
        layers = list(self.text_decoder().layers)

        def training_mode_when_grad(_module: torch.nn.Module, _args: Any) -> None:
            for layer in layers:
                layer.training = torch.is_grad_enabled()

        self.text_decoder().register_forward_pre_hook(training_mode_when_grad)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """End of turn, and end of text (which released checkpoints also stop on)."""
        ids = self.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None and i != self.tokenizer.unk_token_id))

    # -- prompts -------------------------------------------------------------------------------
    @staticmethod
    def _paths(value: Any) -> list[Any]:
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def encode_prompt(self, request: GenRequest) -> TokenPrompt:
        """Chat template over [images, audio clips, text]; each media placeholder repeated once per encoder
        output, as the released processor does."""
        if request.inputs.get("video") is not None:
            raise UsageError("Video prompts are not supported by the qwen3-omni plugin (its video processor needs "
                             "torchvision).", hint="Give images ('image') or audio ('audio') in the record.")
        images = self._paths(request.inputs.get("image"))
        audio = self._paths(request.inputs.get("audio"))
        content = ([{"type": "image", "image": str(p)} for p in images]
                   + [{"type": "audio", "audio": str(p)} for p in audio]
                   + [{"type": "text", "text": request.prompt}])
        messages = [{"role": "user", "content": content}]
        if self.options.system_prompt:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": self.options.system_prompt}]})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        media: dict[str, torch.Tensor] = {}
        counts = {self.image_token_id: [], self.audio_token_id: []}
        if images:
            features, counts[self.image_token_id] = self.media.images(images)
            media.update(features)
        if audio:
            features, counts[self.audio_token_id] = self.media.audio(audio)
            media.update(features)
        return TokenPrompt(torch.tensor(self._expand(ids, counts), dtype=torch.long), media)

    def _expand(self, ids: list[int], counts: dict[int, list[int]]) -> list[int]:
        out: list[int] = []
        pending = {token: list(n) for token, n in counts.items()}
        for token in ids:
            if token in pending:
                if not pending[token]:
                    raise UsageError("The chat template wrote more media placeholders than the record has media.")
                out += [token] * pending[token].pop(0)
            else:
                out.append(token)
        if any(pending.values()):
            raise UsageError("The chat template wrote fewer media placeholders than the record has media; does "
                             "it render 'image' / 'audio' content items?")
        return out

    def media_inputs(self, media):
        return collate_media(list(media))

    # -- serving -------------------------------------------------------------------------------
    source: str = ""  # the directory or hub id the thinker was loaded from (create_model sets it)

    def serving_directory(self) -> str:
        """What a serving engine (vLLM) loads. A released checkpoint (the omni layout) as it is. A thinker saved
        alone (the tiny preset, an omnirl full fine-tune) gets the omni configuration vLLM's model class reads
        (``thinker_config``, no talker), beside links to its files: vLLM maps the thinker's own weight names."""
        import hashlib
        import json

        source = Path(self.source)
        if not source.is_dir():
            return self.source  # a hub id: the engine resolves it as transformers does
        text = (source / "config.json").read_text()
        config = json.loads(text)
        if config.get("model_type") != "qwen3_omni_moe_thinker":
            return str(source.resolve())
        key = hashlib.sha256(f"{source.resolve()}\n{text}".encode()).hexdigest()[:12]

        def build(tmp: Path) -> None:
            from transformers import Qwen3OmniMoeConfig

            for item in source.iterdir():
                if item.name != "config.json":
                    (tmp / item.name).symlink_to(item.resolve())
            omni = Qwen3OmniMoeConfig(thinker_config=config, enable_audio_output=False).to_dict()
            omni["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
            (tmp / "config.json").write_text(json.dumps(omni, indent=2))

        return str(atomic_directory(cache_dir() / "serving" / f"qwen3-omni-thinker-{key}", build))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tiny_directory(seed: int, head_dim: int = 8) -> Path:
    from omnirl_plugin_qwen3_omni.tiny import TINY_VERSION, save_tiny

    wide = "" if head_dim == 8 else f"-hd{head_dim}"
    target = cache_dir() / "presets" / f"qwen3-omni-tiny-v{TINY_VERSION}-seed{seed}{wide}"
    return atomic_directory(target, lambda tmp: save_tiny(tmp, seed=seed, head_dim=head_dim))


def _tiny_omni_directory(seed: int) -> Path:
    from omnirl_plugin_qwen3_omni.tiny import TINY_OMNI_VERSION, TINY_VERSION, save_tiny_omni

    target = cache_dir() / "presets" / f"qwen3-omni-tiny-omni-v{TINY_VERSION}.{TINY_OMNI_VERSION}-seed{seed}"
    return atomic_directory(target, lambda tmp: save_tiny_omni(tmp, seed=seed))


TALKER_PRESET = "tiny-talker"
"""The tiny preset as a whole omni checkpoint (with talker and code2wav), and suggested settings to train the talker."""


def _omni_path(section: ModelSection, options: Qwen3OmniOptions) -> str:
    """A whole omni checkpoint: ``model.path``, the tiny omni preset (``tiny`` or ``tiny-talker``) or the hub's."""
    if section.preset == TALKER_PRESET:
        return section.path or str(_tiny_omni_directory(options.tiny_seed))
    return checkpoint_path(section, "qwen3-omni", lambda: _tiny_omni_directory(options.tiny_seed), DEFAULT_HUB_ID)


def _unreachable(path: str, exc: Exception) -> UsageError:
    return UsageError(
        f"Could not load Qwen3-Omni from '{path}': it is not a local directory and the hub is unreachable or "
        "does not have it.",
        details=[f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"],
        hint="Download the checkpoint to a directory and pass --set model.path=DIR, or use --preset tiny.",
    )


def _optional(loader: Any, source: str) -> Any:
    """A sub-processor, or None when the checkpoint has none (then prompts of that kind are refused)."""
    try:
        return loader.from_pretrained(source)
    except (OSError, ValueError):
        return None


def _processor_chat_template(source: str) -> str | None:
    """The chat template a checkpoint ships for its processor (chat_template.jinja / .json), if any."""
    import json

    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        try:
            file = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
        except OSError:
            file = None
        if file:
            text = Path(file).read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def _checkpoint_config(path: str) -> tuple[str, Any]:
    """(where to load from, its transformers config) for a local directory or a hub id, with clear errors."""
    from transformers import AutoConfig
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    local = Path(path).expanduser()
    looks_local = local.exists() or path.startswith((".", "/", "~"))
    if looks_local and not (local / "config.json").is_file():
        raise UsageError(f"'{path}' is not a transformers checkpoint directory (no config.json).",
                         hint="Point model.path at a Qwen3-Omni checkpoint directory, or use --preset tiny.")
    source = str(local) if looks_local else path
    try:
        return source, AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise _unreachable(path, exc) from exc


def load_thinker(path: str, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any, MediaEncoder]:
    """(thinker, tokenizer, media encoder) from a local directory or a hub id: a full omni checkpoint
    (``qwen3_omni_moe``, the thinker is taken out, the talker never built) or a thinker-only one."""
    from transformers import (
        AutoFeatureExtractor,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    source, config = _checkpoint_config(path)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    if config.model_type == "qwen3_omni_moe":
        thinker = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            source, enable_audio_output=False, **kwargs).thinker
    elif config.model_type == "qwen3_omni_moe_thinker":
        thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(source, **kwargs)
    else:
        raise UsageError(f"'{path}' holds a '{config.model_type}' model, not Qwen3-Omni.",
                         hint="Use a Qwen3-Omni checkpoint (model_type qwen3_omni_moe or qwen3_omni_moe_thinker).")
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _processor_chat_template(source)
    if tokenizer.chat_template is None:
        raise UsageError(f"'{path}' has no chat template (tokenizer or processor).",
                         hint="Add chat_template.jinja (or tokenizer_config.json's chat_template) to the checkpoint.")
    thinker_config = thinker.config
    media = MediaEncoder(
        _optional(AutoImageProcessor, source), _optional(AutoFeatureExtractor, source),
        merge_size=thinker_config.vision_config.spatial_merge_size, n_window=thinker_config.audio_config.n_window,
    )
    return thinker, tokenizer, media


def load_omni(path: str, dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    """(the whole omni model with its talker and code2wav, tokenizer) from a full omni checkpoint."""
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    source, config = _checkpoint_config(path)
    if config.model_type != "qwen3_omni_moe":
        raise UsageError(f"'{path}' holds a '{config.model_type}' model: the talker needs a whole Qwen3-Omni "
                         "checkpoint (model_type qwen3_omni_moe, with talker_config and code2wav_config).",
                         hint="Use a released Qwen3-Omni Instruct checkpoint, --preset tiny, or "
                         "model.options.train=thinker.")
    omni = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        source, enable_audio_output=True, dtype=dtype, attn_implementation=attn_implementation)
    return omni.eval(), AutoTokenizer.from_pretrained(source)


def create_model(section: ModelSection, options: Qwen3OmniOptions | None,
                 device: Any) -> Qwen3OmniThinker | Qwen3OmniTalker:
    options = options or Qwen3OmniOptions()
    from omnirl_core.precision import concrete_dtype

    dtype = _DTYPES[concrete_dtype(section.dtype, torch.device(device).type)]  # 'auto' when called directly
    if options.train != "thinker":
        return _create_talker(section, options, torch.device(device), dtype)
    if options.speak is not None:
        raise UsageError("model.options.speak says what the talker speaks; model.options.train=thinker trains the "
                         "thinker alone (text out, no talker).",
                         hint="Set model.options.train=talker or thinker+talker, or leave speak unset.")
    if section.preset == TALKER_PRESET:
        path = _omni_path(section, options)  # its thinker is the tiny preset's
    else:
        path = checkpoint_path(section, "qwen3-omni", lambda: _tiny_directory(options.tiny_seed, options.tiny_head_dim),
                               DEFAULT_HUB_ID)
    thinker, tokenizer, media = load_thinker(path, dtype, options.attn_implementation)
    model = Qwen3OmniThinker(thinker.to(device), tokenizer, media, options, torch.device(device), dtype)
    model.source = path
    return model


def _create_talker(section: ModelSection, options: Qwen3OmniOptions, device: torch.device,
                   dtype: torch.dtype) -> Qwen3OmniTalker:
    from omnirl_plugin_qwen3_omni.talker import Qwen3OmniTalker

    if options.gradient_checkpointing:
        raise UsageError("gradient_checkpointing applies to the thinker's text decoder trained alone, not to the "
                         "talker.", hint=f"Set model.options.gradient_checkpointing=false with "
                         f"model.options.train={options.train}.")
    joint = options.train == "thinker+talker"
    speak = options.speak or ("reply" if joint else "prompt")
    if joint and speak != "reply":
        raise UsageError("model.options.train=thinker+talker trains the thinker's reply with its speech; with "
                         "speak=prompt the thinker would generate nothing.",
                         hint="Leave model.options.speak unset (or set it to reply), or use model.options.train=talker.")
    path = _omni_path(section, options)
    omni, tokenizer = load_omni(path, dtype, options.attn_implementation)
    if is_flat_layout(omni.thinker):
        import transformers

        raise UsageError(f"The talker is written for the nested thinker layout (thinker.model.language_model); this "
                         f"transformers ({transformers.__version__}) has the flat one (the towers beside a text-only "
                         "thinker.model), for which only the thinker is supported.",
                         hint="Train the talker in the project's environment (not an engine environment with an older "
                         "transformers), or use model.options.train=thinker.")
    model = Qwen3OmniTalker(omni.to(device), tokenizer, options.speaker, device, dtype, speak=speak, joint=joint,
                            reply_max_tokens=options.reply_max_tokens, reply_min_tokens=options.reply_min_tokens,
                            system_prompt=options.system_prompt)
    model.source = path
    return model
