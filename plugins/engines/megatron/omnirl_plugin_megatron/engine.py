"""Megatron-Core training engine for the Qwen3-Omni thinker: tensor parallelism over attention, embeddings and the
output head, expert parallelism over the MoE experts, on the ranks of a torch.distributed group.

Setup, on every rank: (1) the process group (gloo on CPU, nccl on CUDA) and megatron's parallel state
(``initialize_model_parallel``: ``tensor_parallel`` x data parallel for the dense weights; ``expert_parallel`` x
expert tensor parallel (the tensor-parallel size without expert parallelism, else 1) for the experts); (2) the
text decoder built from megatron-core's GPT and MoE blocks (``thinker.build_gpt``) and this rank's shard of the
policy's weights, converted from the transformers layout (``thinker.to_megatron`` + ``shard``); with LoRA
(``model.lora``), the base frozen and adapters on the attention projections that compute what the transformers
thinker's peft adapters compute, starting from them (``lora.py``); (3) a torch AdamW over the local shards of
what is trained (megatron's own optimizer allocates CUDA tensors; AdamW is elementwise, so over shards it is AdamW
over the whole weights). The transformers thinker stays the policy the rollout engines sample from and the
checkpoint's layout: after every optimizer step the engine gathers the shards (a decoder layer at a time; the adapters
at once, with LoRA) and copies them into it; where this worker does not roll out it keeps the thinker in host memory
(``rollout_elsewhere``). The reference policy is scored in megatron (LoRA: the adapters off; full fine-tuning: a
frozen copy of the initial shards), so the thinker's own reference copy is freed.

One training step is the torch engine's (``prepare_all``, minibatches of whole samples, micro-batches through
``algorithm.loss``, rollout-correction fix-ups, clipping, ``finite_update``, ``after_optimizer_step``), with the
scoring forward in megatron: the algorithm sees ``MegatronPolicy``, the thinker whose ``hidden_states`` and
``output_logits`` run the megatron decoder and its vocab-parallel head (full logits, gathered). Ranks of one
tensor-parallel group train on the same samples; data-parallel ranks split each minibatch (``rank_share``) and sum
their gradients.

Gradients beyond what megatron's autograd does (its ``finalize_model_grads`` needs its DDP wrapper, which this
engine does not use): the q/k RMSNorm weights see only their rank's heads, so their gradients are summed over
the tensor-parallel group (as ``finalize_model_grads`` does for ``qk_layernorm``); the MoE all-gather dispatcher
gathers the tokens of every rank of the expert group, and without sequence parallelism (which needs Transformer
Engine or Apex norms) the tensor-parallel ranks hold the same tokens, so each expert sees every token once per
such rank: the expert gradients are divided by that count; dense gradients are summed over the data-parallel
group, expert gradients over the expert data-parallel group.

Checkpoints: ``shards/rank-RRRRR-of-WWWWW.safetensors`` (each rank's shards of the trained parameters and their
AdamW state, megatron names), ``shards/index.json`` (the ranks' layouts, hyperparameters), and on rank 0 the
trained weights in the model's own layout (``model/``: transformers' ``save_pretrained``; with LoRA peft's
``adapter_model.safetensors``). They load on the same layout shard by shard, and on any
other one (another world size, tensor- or expert-parallel size) through the whole tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from omnirl_core.ar.model import CausalLMPolicy
from omnirl_core.config import TrainSection
from omnirl_core.contracts import TrainEngine
from omnirl_core.errors import UsageError
from omnirl_core.loop.distributed import default_backend, ensure_process_group
from omnirl_core.loop.training import (
    MetricMean,
    finite_update,
    micro_batch,
    minibatches,
    prepare_all,
    prepare_batch,
    rank_share,
    rs_corrections,
    split_even,
)
from omnirl_plugin_megatron import lora, shims, thinker
from omnirl_plugin_megatron.thinker import Layout

SHARD_DIR = "shards"
OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


class MegatronOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensor_parallel: int | None = Field(
        None, ge=1, description="Tensor-parallel size (attention heads, embeddings, output head, and the experts' "
        "hidden size when expert_parallel is 1); None: every rank of the group. It divides the number of ranks; "
        "the rest is data parallelism."
    )
    expert_parallel: int = Field(
        1, ge=1, description="Expert-parallel size: the MoE experts are split over this many ranks (each rank "
        "holds num_experts / expert_parallel whole experts). It divides the number of ranks and of experts."
    )
    backend: str | None = Field(
        None, description="torch.distributed backend when the engine forms its own group; None: the device "
        "type's default (gloo on CPU, nccl on CUDA)."
    )
    shuffle: bool = Field(True, description="Shuffle units (seeded by step) before splitting into minibatches.")


class MegatronPolicy(CausalLMPolicy):
    """The thinker as the algorithm scores it during an update: the transformers policy's tokenizer and prompts,
    the megatron decoder's hidden states and logits. Inside ``reference()`` it scores the reference policy in
    megatron too: with LoRA the same shards with the adapters off, in full fine-tuning a frozen copy of the initial
    shards (the engine's ``reference_gpt``). The transformers module takes no part in scoring."""

    def __init__(self, policy: CausalLMPolicy, gpt: Any, engine: MegatronTrainEngine):
        super().__init__(policy.module, policy.tokenizer, policy.device, policy.dtype)
        self.policy = policy
        self.gpt = gpt
        self.engine = engine
        self.lora = policy.lora

    def media_inputs(self, media: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if any(media):
            raise UsageError("The megatron engine trains on text prompts only: this batch has image or audio inputs.",
                             hint="Use train.engine=torch or fsdp2 for prompts with media.")
        return {}

    def hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine.decoder_hidden(inputs["input_ids"], self.gpt)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.engine.output_logits(hidden, self.gpt)

    @contextmanager
    def reference(self) -> Iterator[None]:
        if self.lora is not None:
            with lora.disabled(self.gpt):
                yield
            return
        if self.engine.reference_gpt is None:
            raise RuntimeError("no reference policy: the run keeps none (a separate reference worker, or beta 0)")
        trained, self.gpt = self.gpt, self.engine.reference_gpt
        try:
            yield
        finally:
            self.gpt = trained


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in like]), like)]


class MegatronTrainEngine(TrainEngine):
    distributed = True
    model: CausalLMPolicy

    def __init__(self, model: Any, train: TrainSection, options: MegatronOptions | None, device: Any):
        self.model = model
        self.train = train
        self.options = options or MegatronOptions()
        device = torch.device(device)
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.config = self._text_config(model)
        # LoRA: the transformers thinker's peft adapters (initialised by the run's seed) are the adapters' start
        peft = model.trained_state_dict() if model.lora is not None else {}
        adapted = lora.adapted(list(peft))
        ensure_process_group(self.options.backend or default_backend(device.type))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        tp, ep = self._sizes()
        with shims.cpu_placement(self.on_cpu):
            self._parallel_state(tp, ep)
            self.layout = thinker.current_layout()
            if self.on_cpu:
                shims.install_cpu_rng_tracker(0)  # dropout is 0: it draws nothing
            else:
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(0)
            shims.router_without_transformer_engine()
            # the model's gradient checkpointing is megatron's activation recompute here
            self.recompute = bool(model.recomputes_activations)
            self.gpt = thinker.build_gpt(self.config, model.dtype, tp, ep, self.recompute).to(device).eval()
            # megatron recomputes only in training mode: the decoder block alone gets it (its MoE layers refuse
            # training mode with tensor parallelism but no sequence parallelism; dropout is 0 either way)
            self.gpt.decoder.training = self.recompute
            self._load_hf_weights(self.gpt)
            # full fine-tuning with a reference on this worker: the initial shards, frozen (scored in megatron, so
            # the transformers copy the policy made for it is freed)
            self.reference_gpt = None
            if model.lora is None and model.has_reference_copy:
                self.reference_gpt = thinker.build_gpt(self.config, model.dtype, tp, ep).to(device).eval()
                self._load_hf_weights(self.reference_gpt)
                self.reference_gpt.requires_grad_(False)
                model.drop_reference_copy()
            if peft:
                self._add_adapters(peft, adapted, tp)
        self.params = [(n, p) for n, p in self.gpt.named_parameters() if p.requires_grad]
        self._groups()
        self._mask_padding_row()
        self.optimizer = torch.optim.AdamW([p for _, p in self.params], lr=train.lr,
                                           betas=(train.betas[0], train.betas[1]), weight_decay=train.weight_decay)
        self.policy = MegatronPolicy(model, self.gpt, self)

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _text_config(model: Any) -> Any:
        config = getattr(getattr(getattr(model, "module", None), "config", None), "text_config", None)
        if config is None or getattr(config, "model_type", "") != "qwen3_omni_moe_text":
            raise UsageError(
                f"The megatron engine trains the Qwen3-Omni thinker; this model is {type(model).__name__}.",
                hint="Use --model qwen3-omni, or train.engine=torch / fsdp2 for other models.")
        return config

    def _sizes(self) -> tuple[int, int]:
        tp = self.options.tensor_parallel or self.world_size
        ep = self.options.expert_parallel
        c = self.config
        problems = []
        if self.world_size % tp:
            problems.append(f"tensor_parallel {tp} does not divide the {self.world_size} ranks")
        if self.world_size % ep:
            problems.append(f"expert_parallel {ep} does not divide the {self.world_size} ranks")
        if c.num_key_value_heads % tp:
            problems.append(f"tensor_parallel {tp} does not divide the {c.num_key_value_heads} key/value heads")
        if c.vocab_size % tp:
            problems.append(f"tensor_parallel {tp} does not divide the vocabulary ({c.vocab_size})")
        if ep > 1 and c.num_experts % ep:
            problems.append(f"expert_parallel {ep} does not divide the {c.num_experts} experts")
        if ep == 1 and c.moe_intermediate_size % tp:
            problems.append(f"tensor_parallel {tp} does not divide the experts' hidden size {c.moe_intermediate_size}")
        if problems:
            raise UsageError("Invalid megatron parallel sizes: " + "; ".join(problems) + ".",
                             hint="Set train.options.tensor_parallel / expert_parallel to divisors of the rank "
                             "count (run.train_workers) and of the model's sizes.")
        return tp, ep

    def _parallel_state(self, tp: int, ep: int) -> None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            same = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()) == (tp, ep)
            if same:
                return
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=tp if ep == 1 else 1,
                                     create_gloo_process_groups=False)

    def _groups(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.expert_group = ps.get_expert_tensor_and_model_parallel_group()
        self.edp_group = ps.get_expert_data_parallel_group()
        # ranks of this rank's expert group that hold the same tokens (its tensor-parallel peers): each token
        # reaches every expert that many times through the all-gather dispatcher
        same_tokens = set(dist.get_process_group_ranks(self.tp_group))
        self.token_copies = len(same_tokens & set(dist.get_process_group_ranks(self.expert_group)))

    def _load_hf_weights(self, gpt: Any) -> None:
        # with LoRA, peft holds each adapted layer's weight as ``<layer>.base_layer.weight``
        hf = {k.replace(".base_layer.", "."): v for k, v in self.model.module.state_dict().items() if ".lora_" not in k}
        full = thinker.to_megatron({k: hf[k] for k in thinker.hf_names(self.config)}, self.config)
        local = thinker.shard(full, self.layout, self.config.num_experts)
        result = gpt.load_state_dict({k: v.to(self.device) for k, v in local.items()}, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"weight conversion: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")

    def _add_adapters(self, peft: dict[str, torch.Tensor], adapted: dict[int, list[str]], tp: int) -> None:
        """LoRA adapters on the adapted layers (``lora.py``), this rank's shards of peft's; the rest frozen."""
        settings = self.model.lora
        dtype = next(iter(peft.values())).dtype  # the float32 master copies
        lora.add_adapters(self.gpt, self.config, adapted, settings.rank, settings.alpha, tp, dtype, self.device)
        local = thinker.shard(lora.to_megatron(peft), self.layout, self.config.num_experts)
        params = dict(self.gpt.named_parameters())
        trained = {n for n, p in params.items() if p.requires_grad}
        if trained != set(local):
            raise RuntimeError(f"LoRA adapters: megatron has {sorted(trained ^ set(local))[:5]} unmatched")
        with torch.no_grad():
            for name, value in local.items():
                params[name].copy_(value)

    def _mask_padding_row(self) -> None:
        """transformers' embedding has ``padding_idx`` (the pad token's row gets no gradient); megatron's has none."""
        pad = getattr(self.config, "pad_token_id", None)
        weight = self.gpt.embedding.word_embeddings.weight
        if pad is None or not weight.requires_grad:  # LoRA: the embedding is frozen
            return
        start = self.layout.tp_rank * weight.shape[0]
        if start <= pad < start + weight.shape[0]:
            row = pad - start
            weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([row], device=grad.device), 0.0))

    # -- forward (MegatronPolicy calls these) --------------------------------------------------
    def decoder_hidden(self, input_ids: torch.Tensor, gpt: Any) -> torch.Tensor:
        """Hidden states (B, S, H). With data parallelism every rank's batch is padded to the largest (B, S) of
        the group first: the expert all-gather takes equal sizes from every rank."""
        with shims.cpu_placement(self.on_cpu):
            batch, length = input_ids.shape
            if self.dp_size > 1:
                size = torch.tensor([batch, length], dtype=torch.int64, device=self.device)
                dist.all_reduce(size, op=dist.ReduceOp.MAX)
                padded = torch.full(tuple(size.tolist()), self.model.pad_token_id, dtype=input_ids.dtype,
                                    device=input_ids.device)
                padded[:batch, :length] = input_ids
                input_ids = padded
            return thinker.decoder_hidden(gpt, input_ids)[:batch, :length]

    def output_logits(self, hidden: torch.Tensor, gpt: Any) -> torch.Tensor:
        with shims.cpu_placement(self.on_cpu):
            return thinker.output_logits(gpt, hidden)

    def rollout_elsewhere(self) -> None:
        """No rollout on this worker: the transformers thinker (only the export target now) goes to host memory, so
        the accelerator holds the shards, their gradients and optimizer state, and the activations."""
        if not self.on_cpu:
            self.model.move_to("cpu")

    # -- update --------------------------------------------------------------------------------
    def update(self, algorithm: Any, units: list[Any], step: int,
               reference: Callable[[], list[dict[str, Any]]] | None = None) -> dict[str, float]:
        """One training step; ``reference``: a separate reference worker's outputs (``training.prepare_all``)."""
        metrics = MetricMean()
        prepare_all(algorithm, self.policy, units, prepare_batch(self.train, len(units)), metrics, reference)
        for index, minibatch in enumerate(minibatches(units, self.train.minibatches, step, self.options.shuffle)):
            self.optimizer.zero_grad(set_to_none=True)
            mine = rank_share(minibatch, self.dp_rank, self.dp_size)
            # every rank runs as many micro-batches as the busiest: the expert all-gather pairs them up
            busiest = max(len(rank_share(minibatch, r, self.dp_size)) for r in range(self.dp_size))
            mbs = micro_batch(self.train, busiest)
            losses = []
            for micro in split_even(mine, -(-busiest // mbs)):
                loss, m = self._backward(algorithm, micro, minibatch, first_update=index == 0)
                losses.append(float(loss.detach()))
                metrics.add({"loss": losses[-1], **m}, len(micro))  # an empty share: names only
            fix = rs_corrections(algorithm, mine, metrics, filler=minibatch[:1])
            count = torch.tensor([-(-len(fix) // mbs)], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            for micro in split_even(fix, int(count.item())):
                self._backward(algorithm, micro, minibatch, correction=True)
            self._reduce_gradients()
            grad_norm = self._clip(self.train.max_grad_norm)
            if finite_update(grad_norm, losses, step, index, self.train.nonfinite, metrics):
                metrics.add({"grad_norm": grad_norm}, 1.0)
                self.optimizer.step()
                self._export()
                algorithm.after_optimizer_step(self.model)  # on the synced transformers policy
            self.optimizer.zero_grad(set_to_none=True)
        metrics.all_reduce(self.device)
        return metrics.result()

    def _backward(self, algorithm: Any, micro: list[Any], minibatch: list[Any], **kwargs: Any):
        with shims.cpu_placement(self.on_cpu):
            loss, m = algorithm.loss(self.policy, micro or minibatch[:1], **kwargs)
            # each data-parallel rank's share of the minibatch: the summed gradients are one process's
            (loss * (len(micro) / len(minibatch))).backward()
        return loss, m

    def _reduce_gradients(self) -> None:
        for _, p in self.params:  # every rank joins the collectives with every tensor
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        qk = [p.grad for n, p in self.params if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))]
        if self.layout.tp > 1 and qk:
            self._all_reduce(qk, self.tp_group)
        experts = [p.grad for n, p in self.params if thinker.is_expert(n)]
        if self.token_copies > 1:
            for g in experts:
                g.div_(self.token_copies)
        if self.dp_size > 1:
            self._all_reduce([p.grad for n, p in self.params if not thinker.is_expert(n)], self.dp_group)
        if experts and dist.get_world_size(self.edp_group) > 1:
            self._all_reduce(experts, self.edp_group)

    @staticmethod
    def _all_reduce(tensors: list[torch.Tensor], group: Any) -> None:
        flat = _flat(tensors)
        dist.all_reduce(flat, group=group)
        for t, value in zip(tensors, _unflat(flat, tensors)):
            t.copy_(value)

    def _clip(self, max_norm: float) -> float:
        """The global gradient norm (each weight counted once over all shards) and clipping to ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process."""
        split, replicated, experts = [], [], []
        for name, p in self.params:
            assert p.grad is not None
            square = p.grad.detach().float().pow(2).sum()
            if thinker.is_expert(name):
                experts.append(square)
            elif thinker._split_rule(name)[0] != "dup" and self.layout.tp > 1:
                split.append(square)
            else:
                replicated.append(square)
        sums = torch.stack([torch.stack(s).sum() if s else torch.zeros((), device=self.device)
                            for s in (split, replicated, experts)])
        if self.layout.tp > 1:
            dist.all_reduce(sums[0], group=self.tp_group)
        if dist.get_world_size(self.expert_group) > 1:
            dist.all_reduce(sums[2], group=self.expert_group)
        total = sums.sum().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, p in self.params:
            assert p.grad is not None
            p.grad.mul_(coef.to(p.grad.dtype))
        return float(total)

    # -- weights for sync and export -----------------------------------------------------------
    def _gathered(self, tensors: dict[str, torch.Tensor]) -> list[tuple[Layout, dict[str, torch.Tensor]]]:
        """Every rank's local tensors (the same names and shapes on every rank), with each rank's layout."""
        names = list(tensors)
        flat = _flat([tensors[n].detach().contiguous() for n in names])
        everyone = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(everyone, flat)
        coords = torch.tensor(list(self.layout.to_json().values()), dtype=torch.int64, device=self.device)
        layouts = torch.empty(self.world_size * coords.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(layouts, coords)
        out = []
        for r, (piece, layout) in enumerate(zip(everyone.chunk(self.world_size), layouts.chunk(self.world_size))):
            values = _unflat(piece, [tensors[n] for n in names])
            out.append((Layout(*layout.tolist()), dict(zip(names, values))))
        return out

    def _export(self) -> None:
        """Copy the trained weights into the transformers policy (what the rollout samples and checkpoints
        save). Collective. Full fine-tuning gathers one decoder layer at a time (then the embedding, final norm and
        head), so what a rank holds for it at once is one layer, whole, twice (megatron's and transformers' layout)
        besides every rank's piece of it."""
        if self.model.lora is not None:  # the adapters, under peft's names: the weight-sync path's LoRA state
            with shims.cpu_placement(self.on_cpu):
                pieces = self._gathered({n: p for n, p in self.params})
            self.model.load_trained_state_dict(lora.to_peft(thinker.unshard(pieces, self.config.num_experts)))
            return
        parts: dict[int | None, dict[str, torch.Tensor]] = {}
        for name, param in self.params:  # the same names on every rank, in the same order
            parts.setdefault(thinker.layer_of(name), {})[name] = param
        state = self.model.module.state_dict()
        for layer, tensors in parts.items():
            with shims.cpu_placement(self.on_cpu):
                pieces = self._gathered(tensors)
            full = thinker.unshard(pieces, self.config.num_experts)
            hf = thinker.to_hf(full, self.config, layers=[] if layer is None else [layer], outside=layer is None)
            with torch.no_grad():
                for name, value in hf.items():
                    state[name].copy_(value)
            del pieces, full, hf

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights as whole CPU tensors in the model's layout, the adapters under peft's names with
        LoRA (the policy is synced after every optimizer step and every load)."""
        return self.model.trained_state_dict()

    # -- sharded checkpoints -------------------------------------------------------------------
    def _shard_file(self, directory: Path, rank: int, world: int) -> Path:
        return directory / SHARD_DIR / f"rank-{rank:05d}-of-{world:05d}.safetensors"

    def save_state(self, directory: Path, rank: int) -> list[str]:
        """Every rank writes its parameter and AdamW shards; rank 0 also writes the trained weights in the
        model's own layout. Collective."""
        directory = Path(directory)
        (directory / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, param in self.params:
            tensors[f"param/{name}"] = param.detach().cpu().contiguous()
            for key, value in self.optimizer.state.get(param, {}).items():
                tensors[f"optim/{name}/{key}"] = value.detach().cpu().contiguous()
        save_file(tensors, str(self._shard_file(directory, self.rank, self.world_size)))
        layouts = [None] * self.world_size
        dist.all_gather_object(layouts, self.layout.to_json())
        files = [f"{SHARD_DIR}/"]
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            index = {"world_size": self.world_size, "layouts": layouts, "param_groups": groups}
            (directory / SHARD_DIR / "index.json").write_text(json.dumps(index, indent=2))
            files += self.model.save_trained(directory)
        dist.barrier()
        return files

    def load_state(self, directory: Path) -> None:
        """What ``save_state`` wrote, on this layout or any other; then the policy is synced."""
        directory = Path(directory)
        index = json.loads((directory / SHARD_DIR / "index.json").read_text())
        saved_world = int(index["world_size"])
        layouts = [Layout(**entry) for entry in index["layouts"]]
        if saved_world == self.world_size and layouts[self.rank] == self.layout:
            mine = load_file(str(self._shard_file(directory, self.rank, saved_world)))
        else:
            mine = self._reshard([load_file(str(self._shard_file(directory, r, saved_world)))
                                  for r in range(saved_world)], layouts)
        with torch.no_grad():
            for name, param in self.params:
                if f"param/{name}" not in mine:
                    raise ValueError(f"checkpoint {directory} has no shard for parameter '{name}'")
                param.copy_(mine[f"param/{name}"])
                state = {key: mine[f"optim/{name}/{key}"].to(param.device) for key in OPTIM_KEYS
                         if f"optim/{name}/{key}" in mine}
                if f"optim/{name}/step" in mine:
                    state["step"] = mine[f"optim/{name}/step"].clone()
                if state:
                    self.optimizer.state[param] = state
        for group, saved in zip(self.optimizer.param_groups, index["param_groups"]):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        self._export()

    def _reshard(self, files: list[dict[str, torch.Tensor]], layouts: list[Layout]) -> dict[str, torch.Tensor]:
        """This rank's shards from a checkpoint of another layout: whole tensors, then this layout's split."""
        experts = self.config.num_experts

        def resharded(prefix: str, suffix: str) -> dict[str, torch.Tensor]:
            pieces = [(layout, {key[len(prefix):len(key) - len(suffix)]: t for key, t in file.items()
                                if key.startswith(prefix) and key.endswith(suffix)})
                      for layout, file in zip(layouts, files)]
            local = thinker.shard(thinker.unshard(pieces, experts), self.layout, experts)
            return {f"{prefix}{name}{suffix}": t for name, t in local.items()}

        out = resharded("param/", "")
        for key in OPTIM_KEYS:
            out.update(resharded("optim/", f"/{key}"))
        step = next((t for key, t in files[0].items() if key.endswith("/step")), None)
        if step is not None:  # AdamW's step count: the same for every weight
            out.update({f"optim/{name}/step": step for name, _ in self.params})
        return out

