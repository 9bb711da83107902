"""The memory plan of a resolved run: per worker group, what one device holds, against the device's memory.

Rows per device (bytes): every component's weights at the model dtype (the trained ones sharded over the FSDP2
ranks; text encoders and VAE resident, or offloaded to host memory with ``model.offload: cpu``); the trainable
parameters' fp32 master copy (LoRA adapters; full fine-tuning keeps them in the model dtype, as the engines do),
their gradients and AdamW's two moments, all sharded; a frozen reference copy (full fine-tuning with a KL term
evaluated in the actor: the engines do not shard it); an EMA shadow of the trained parameters; FSDP2's gathered
blocks; the activations of one training micro-batch (traced on ``meta`` from the real architecture, with the
configured gradient checkpointing and CFG), of one rollout model call (``max_num_seqs`` requests), and of one VAE
decode. Rollout and training take turns on a shared device, so the larger of their activation peaks counts.

A train engine that declares tensor or expert parallelism (``EngineSpec.parallel``, degrees from its options) splits
the trained parameters, their gradients and optimizer state as megatron-core lays them out: tensor parallelism the
linear and embedding layers (``ModelSizing.tensor_split``), expert parallelism the MoE experts
(``ModelSizing.experts``; without it, tensor parallelism splits them too), the rest (norms, a router) whole on every
rank; data-parallel ranks hold copies. Tensor parallelism also splits most of a layer's activations (5 + 12/t hidden
vectors per token instead of 17), sequence parallelism the tokens. An engine that ``keeps_model`` holds the model
plugin's module whole besides its shards, and gathers every rank's shards after each optimizer step.

Host memory beside a device (``GroupPlan.host``): offloaded encoders, a step's samples on the rollout's worker, the
CPU copy of the trained weights a weight sync moves. ``omnirl_core.planning.nodes`` adds them up per node.

Not counted: reward models (their own workers or the CPU), the CUDA context and allocator fragmentation (the
``headroom`` fraction of the device stays free for them), the driver's own host memory.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirl_core.errors import ConfigError, PluginError, UsageError
from omnirl_core.planning.model import ModelSizing, model_dtype

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig
    from omnirl_core.resolve import ResolvedRun

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.10
"""Fraction of a device's memory left free for the CUDA context, kernels' workspaces and fragmentation."""


def parse_bytes(text: str | float) -> int:
    """``80GiB``, ``80GB`` (10^9), ``141 GiB``, ``512MiB`` or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"Cannot read the memory size '{text}'.", hint="Write it like 80GiB, 141GB or 512MiB.")
    number, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


@dataclass
class GroupPlan:
    """One worker group: ``devices`` devices, each holding ``rows`` (name -> bytes)."""

    name: str
    devices: int
    rows: dict[str, int]
    notes: list[str] = field(default_factory=list)
    host: dict[str, int] = field(default_factory=dict)
    """What each of the group's workers holds in its node's host memory besides its device (name -> bytes):
    offloaded encoders, a step's samples, the CPU copy of the trained weights a weight sync moves. Empty on the
    CPU, where ``rows`` are host memory already."""

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


@dataclass
class MemoryPlan:
    groups: list[GroupPlan]
    device_memory: int | None
    dtype: str
    notes: list[str] = field(default_factory=list)
    fixes: list[tuple[str, int]] = field(default_factory=list)
    """Single changes that would make a plan that does not fit fit: (``--set`` text, the new largest total)."""
    tried: list[str] = field(default_factory=list)
    """The changes tried for ``fixes`` (``--set`` texts), fitting or not."""
    memory_source: str = ""
    """Where ``device_memory`` comes from when not given (e.g. ``of RAM available now``), for the messages."""
    architecture: str = "released"
    """What the weights and activations are of: ``released`` (the full-size model) or the preset's name."""
    shared: bool = False
    """Every worker group's devices are one memory (the CPU: the host's), which holds them all at once."""
    parallel: dict[str, int] = field(default_factory=dict)
    """The train engine's parallel degrees the plan used (``parallel_degrees``); empty: it declares none."""

    @property
    def budget(self) -> int | None:
        return None if self.device_memory is None else int(self.device_memory * (1 - HEADROOM))

    @property
    def peak(self) -> int:
        """The largest total of one device; on a shared memory, of all of them together."""
        if self.shared:
            return sum(g.total * g.devices for g in self.groups)
        return max(g.total for g in self.groups)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "device_memory": self.device_memory,
            "budget": self.budget,
            "fits": self.fits,
            "groups": [{"name": g.name, "devices": g.devices, "rows": g.rows, "total": g.total, "notes": g.notes,
                        "host": g.host, "host_total": g.host_total} for g in self.groups],
            "notes": self.notes,
            "fixes": [{"set": s, "largest_total": t} for s, t in self.fixes],
            "tried": self.tried,
            "architecture": self.architecture,
            "parallel": self.parallel,
        }

    def table(self) -> str:
        """A plain-text table: one column per worker group, GiB per device."""
        names = list(dict.fromkeys(row for g in self.groups for row in g.rows))
        head = ["per device (GiB)"] + [f"{g.name} x{g.devices}" for g in self.groups]
        lines = [head]
        for row in names:
            if any(g.rows.get(row, 0) for g in self.groups):
                lines.append([row] + [_gib(g.rows[row]) if row in g.rows else "-" for g in self.groups])
        lines.append(["total"] + [_gib(g.total) for g in self.groups])
        if self.device_memory is not None:
            lines.append([f"budget ({self.device_memory / GIB:.0f} GiB{self._source} less {HEADROOM:.0%} headroom)"]
                         + [_gib(self.budget or 0)] * len(self.groups))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
               for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        verdict = ("fits" if self.fits else "DOES NOT FIT") if self.device_memory is not None else "no device size given"
        where = ("all worker groups together on one memory" if self.shared and self._several
                 else f"largest {self.peak / GIB:.1f} GiB per device")
        if self.shared and self._several:
            where += f" {self.peak / GIB:.1f} GiB"
        out.append(f"{verdict}: {where} (weights {self.dtype})")
        out += [f"note: {n}" for n in self.notes + [n for g in self.groups for n in g.notes]]
        return "\n".join(out)

    @property
    def _several(self) -> bool:
        return sum(g.devices for g in self.groups) > 1

    @property
    def _source(self) -> str:
        return f" {self.memory_source}" if self.memory_source else ""


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _amount(n: int) -> str:
    """A device's memory for a message: whole GiB, or MiB below one GiB."""
    return f"{n / GIB:.0f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def rollout_batch_size(config: RunConfig) -> int:
    """Requests in one rollout model call: the engine's ``max_num_seqs`` (diffusers) or ``max_batch_size``
    (transformers), 32 by default in both, and never more than a step's samples (or an evaluation's)."""
    options = config.rollout.options or {}
    cap = int(options.get("max_num_seqs", options.get("max_batch_size", 32)))
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    if config.run.eval_every is not None:  # run.eval_prompts None: every test prompt, a full call at most
        run = config.run
        samples = max(samples, cap if run.eval_prompts is None else run.eval_prompts * run.eval_samples)
    return max(1, min(cap, samples))


def train_micro_batch(config: RunConfig) -> int:
    """Transitions in one training forward/backward call: ``train.micro_batch_size``, and never more than a rank's
    share of a minibatch holds (every step of its samples: ``rollout.num_steps`` transitions per sample at most);
    ``auto``: that whole share (``auto_micro_batch`` lowers it where the plan would not fit)."""
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    run = config.run
    ranks = run.train_workers if run.executor == "ray" and run.placement == "split" else 1
    per_minibatch = -(-samples // config.train.minibatches)
    per_rank = -(-per_minibatch // ranks) * max(1, config.rollout.num_steps)
    size = config.train.micro_batch_size
    return max(1, per_rank if size == "auto" else min(size, per_rank))


def auto_micro_batch(resolved: ResolvedRun, sizing: ModelSizing, device_memory: int | None,
                     device_type: str | None = None) -> int | None:
    """``train.micro_batch_size: auto`` as a number: the whole of a rank's minibatch share in one call when the plan
    fits ``device_memory``, else the largest half, quarter, ... of it that does (1 when none does: the plan's
    own refusal then says what would fit). None when the setting is a number, or there is no memory to fit."""
    if resolved.config.train.micro_batch_size != "auto" or device_memory is None:
        return None
    size = train_micro_batch(resolved.config)
    while size > 1:
        plan = _replan(resolved, sizing, device_memory, device_type, {"train": {"micro_batch_size": size}})
        if plan is not None and plan.fits:
            return size
        size = -(-size // 2)
    return 1


def load_sizing(resolved: ResolvedRun) -> ModelSizing:
    spec = resolved.model
    ref = spec.sizing
    if ref is None:
        raise PluginError(
            f"Model '{spec.name}' does not describe its full-size architecture (no sizing in its ModelSpec): "
            "omnirl cannot plan its memory.",
            hint=f"Update {spec.plugin or 'the plugin'}, or ask its authors to add ModelSpec.sizing "
            "(see CONTRIBUTING, 'Memory plans').")
    from omnirl_core.registry import load_object

    return load_object(ref)(resolved.config, resolved.options.get("model.options"))


def _activation_bytes(sizing: ModelSizing, config: RunConfig, dtype_bytes: int, checkpointing: bool,
                      tensor: int = 1, sequence: int = 1) -> tuple[int, int]:
    """(training micro-batch peak, rollout call peak) of the trained network; ``tensor`` / ``sequence``: the train
    engine's degrees (tensor parallelism splits most of a layer's activations, sequence parallelism the tokens;
    the float32 logits are gathered whole)."""
    from omnirl_core.planning.activations import no_grad_peak, trace_activations, transformer_activation_bytes

    micro = train_micro_batch(config)
    rollout_batch = rollout_batch_size(config)
    lora_rank = config.model.lora.rank if sizing.lora else None
    extra_train, extra_rollout = sizing.per_sample_bytes * micro, sizing.per_sample_bytes * rollout_batch
    cfg = config.rollout.guidance_scale > 1.0
    both = cfg and config.train.cfg_grad == "both"  # both branches' rows in one call with grad
    if sizing.probe is not None:
        acts = trace_activations(sizing.probe, 2 * micro if both else micro, lora_rank, checkpointing)
        train = acts.with_cfg() if cfg and not both else acts.peak
        # a traced network under tensor parallelism: the generic estimate's share (Korthikanti et al. 2022)
        train = train * (5 * tensor + 12) // (17 * tensor) // sequence
        return train + extra_train // sequence, no_grad_peak(sizing.probe, rollout_batch) + extra_rollout
    train = transformer_activation_bytes(sizing.tokens, sizing.hidden, sizing.layers, 2 * micro if both else micro,
                                         dtype_bytes, checkpointing, tensor) // sequence
    extra_train //= sequence
    rollout = transformer_activation_bytes(sizing.tokens, sizing.hidden, 1, rollout_batch, dtype_bytes, False)
    return train + extra_train, rollout + extra_rollout


def cfg_state(config: RunConfig) -> str:
    if config.rollout.guidance_scale <= 1.0:
        return "off"
    return "on, both branches with grad" if config.train.cfg_grad == "both" else "on"


_DECODES: dict[tuple[Any, ...], int] = {}


def _decode_bytes(sizing: ModelSizing, config: RunConfig) -> int:
    if sizing.decoder is None:
        return 0
    from omnirl_core.planning.activations import peak_live_bytes, stored

    decoder = sizing.decoder
    one = _DECODES.get(decoder.key) if decoder.key else None
    if one is None:
        def trace() -> int:
            module = decoder.build()
            return peak_live_bytes(module, lambda: decoder.run(module, 1))

        one = int(stored(("decode", decoder.key), trace)) if decoder.key else trace()
        if decoder.key:
            _DECODES[decoder.key] = one
    return one * rollout_batch_size(config)  # a decode's intermediates grow with the batch: traced at batch 1


def rollout_state_bytes(cfg: RunConfig) -> dict[str, int]:
    """What a step's samples hold in host memory: decoded outputs (float32) and latent trajectories."""
    r = cfg.rollout
    samples = r.prompts_per_step * r.group_size
    pixels = r.height * r.width * (r.num_frames or 1)
    outputs = samples * 3 * pixels * 4
    latents = samples * (r.num_steps + 1) * max(pixels // 64, 1) * 16 * 4
    return {"samples": samples, "outputs": outputs, "trajectories": latents, "total": outputs + latents}


PARALLEL_SPLITS = ("tensor", "expert")
"""The kinds of parallelism that split the trained parameters themselves (not data-parallel copies)."""


def parallel_degrees(resolved: ResolvedRun, sizing: ModelSizing, ranks: int) -> dict[str, int]:
    """The train engine's degrees over its ``ranks``: each kind it declares (``EngineSpec.parallel``) from its
    option in ``train.options`` (None: every rank), ``data`` what tensor parallelism leaves (expert and sequence
    parallelism reuse the data-parallel ranks, as megatron-core and VeOmni arrange them). A degree that does not
    divide the ranks, or what it splits (``ModelSizing.parallel_units``), is a usage error (exit 2) naming each."""
    declared = dict(resolved.train_engine.parallel)
    if not declared:
        return {}
    options = resolved.dump()["train"]["options"] or {}
    degrees: dict[str, int] = {}
    problems: list[str] = []
    for kind, option in declared.items():
        if not option:
            continue
        value = options.get(option)
        degree = ranks if value is None else int(value)
        degrees[kind] = degree
        where = f"train.options.{option}={degree} ({kind} parallel)"
        if degree < 1 or ranks % degree:
            problems.append(f"{where} does not divide the {ranks} train rank{'s' * (ranks != 1)}"
                            + (" (run.train_workers with run.placement split)" if ranks > 1 else
                               " (one worker trains unless run.executor is ray, run.placement split and "
                               "run.train_workers > 1)"))
        units = sizing.parallel_units.get(kind)
        if units is not None and degree > 1 and units[0] % degree:
            verb = "exceeds" if degree > units[0] else "does not divide"
            problems.append(f"{where} {verb} the model's {units[0]} {units[1]}")
        elif units is None and degree > 1 and kind in PARALLEL_SPLITS:
            raise PluginError(
                f"Model '{resolved.model.name}' does not tell the planner what {kind} parallelism splits "
                f"(ModelSizing.parallel_units has no '{kind}'): omnirl cannot plan train engine "
                f"'{resolved.train_engine.name}' with {where}.",
                hint="Plan with that degree at 1, or ask the model plugin's authors to describe it (see CONTRIBUTING, "
                "'Memory plans').")
    if problems:
        raise UsageError(f"Invalid parallel degrees for train engine '{resolved.train_engine.name}' over {ranks} "
                         f"rank{'s' * (ranks != 1)}.", details=[f"  {p}" for p in problems],
                         hint="Set each degree to a divisor of run.train_workers and of what it splits.")
    if "data" in declared:
        degrees["data"] = max(1, ranks // degrees.get("tensor", 1))
    return degrees


def trained_per_rank(sizing: ModelSizing, degrees: dict[str, int]) -> int:
    """Trainable parameters one rank holds under tensor / expert parallelism, laid out as megatron-core does: the
    experts over the expert-parallel ranks (over the tensor-parallel ones when there is no expert parallelism),
    the linear and embedding layers over the tensor-parallel ranks, the rest whole. LoRA adapters: the part the model
    says tensor parallelism splits (``lora_tensor_split``) over the tensor ranks, the rest whole."""
    if sizing.lora:
        tp = degrees.get("tensor", 1)
        return sizing.trainable - sizing.lora_tensor_split + sizing.lora_tensor_split // tp
    tp, ep = degrees.get("tensor", 1), degrees.get("expert", 1)
    whole = sizing.trainable - sizing.experts - sizing.tensor_split
    return whole + sizing.tensor_split // tp + sizing.experts // (ep if ep > 1 else tp)


def base_per_rank(sizing: ModelSizing, degrees: dict[str, int]) -> int:
    """With LoRA: the frozen base weights one rank of a model-parallel engine holds in its own layout, split as
    ``trained_per_rank`` splits a full fine-tuning's: the tensor-split layers and the experts, and the weights every
    rank holds whole (``replicated``: norms, a MoE router)."""
    tp, ep = degrees.get("tensor", 1), degrees.get("expert", 1)
    return sizing.replicated + sizing.tensor_split // tp + sizing.experts // (ep if ep > 1 else tp)


def degrees_text(degrees: dict[str, int]) -> str:
    return ", ".join(f"{kind} {degree}" for kind, degree in degrees.items())


def plan_memory(resolved: ResolvedRun, device_memory: int | None = None, sizing: ModelSizing | None = None,
                suggest: bool = True, device_type: str | None = None, memory_source: str = "") -> MemoryPlan:
    """The plan of ``resolved`` (a ``ResolvedRun``); ``device_memory``: bytes per device (None: no verdict).
    ``device_type`` ``cpu``: the device's memory is the host's, which also holds a step's samples (their decoded
    outputs and trajectories, ``plan.memory``): a row of the rollout's group."""
    cfg = resolved.config
    sizing = sizing or load_sizing(resolved)
    dtype = model_dtype(cfg)
    wb = DTYPE_BYTES[dtype]
    dump = resolved.dump()  # the model's and the algorithm's own options, as configured
    checkpointing = bool((dump["model"]["options"] or {}).get("gradient_checkpointing", False))
    run = cfg.run

    split = run.executor == "ray" and run.placement == "split"
    ranks = run.train_workers if split else 1
    engine = resolved.train_engine
    degrees = parallel_degrees(resolved, sizing, ranks)
    model_parallel = any(kind in degrees for kind in PARALLEL_SPLITS)
    sharded = engine.shards and ranks > 1 and not model_parallel
    shard = ranks if sharded else 1
    offload = cfg.model.offload == "cpu"

    # trainable state: LoRA adapters hold an fp32 master copy; full fine-tuning keeps the model dtype
    tb = 4 if sizing.lora else wb
    trainable = sizing.trainable
    algo_options = dump["algorithm"]["options"] or {}
    uses_reference = resolved.algorithm.needs_reference and float(algo_options.get("beta", 0.0) or 0.0) > 0
    ema = resolved.algorithm.needs_ema or bool(algo_options.get("ema", False))
    trained_numel = sum(sizing.components[c] for c in sizing.trained)

    def weights(rows: dict[str, int], shard_trained: int) -> None:
        for name, numel in sizing.components.items():
            if name in sizing.trained:
                rows[f"weights/{name}"] = numel * wb // shard_trained
            elif name in sizing.encoders and offload:
                continue
            else:
                rows[f"weights/{name}"] = numel * wb

    train_act, rollout_act = _activation_bytes(sizing, cfg, wb, checkpointing, degrees.get("tensor", 1),
                                               degrees.get("sequence", 1))
    decode = _decode_bytes(sizing, cfg)
    seqs = rollout_batch_size(cfg)
    phases = (f"activations by phase (they take turns): train micro-batch of {train_micro_batch(cfg)} "
              f"{train_act / GIB:.2f} GiB (gradient checkpointing {'on' if checkpointing else 'off'}, CFG "
              f"{cfg_state(cfg)}), rollout call of {seqs} {rollout_act / GIB:.2f} GiB, "
              f"VAE decode of {seqs} {decode / GIB:.2f} GiB")

    actor: dict[str, int] = {}
    export = 0
    host_model = 0  # bytes of the model's module a train rank keeps in host memory instead
    if model_parallel:
        per_rank = trained_per_rank(sizing, degrees)
        if engine.keeps_model:
            # the model's module, whole, besides the engine's own shards: on the device, or in host memory where the
            # worker does not roll out (split placement on an accelerator: ``TrainEngine.rollout_elsewhere``)
            if split and (device_type or run.device) != "cpu":
                host_model = sum(sizing.components.values()) * wb
            else:
                weights(actor, 1)
            actor[f"weights ({engine.name} shards)"] = per_rank * tb
            if sizing.lora:  # the engine's own layout holds the frozen base too, besides its adapter shards
                actor[f"weights ({engine.name} frozen base shards)"] = base_per_rank(sizing, degrees) * wb
            # after each optimizer step the shards are gathered and converted into the module: the adapters at
            # once; full weights a block at a time (every rank's piece of it, the whole block twice: both layouts)
            if sizing.lora or not sizing.largest_block:
                export = ((ranks + 1) * per_rank + trainable) * tb
            else:
                piece = sizing.largest_block * per_rank // max(1, trainable)
                export = (ranks * piece + 2 * sizing.largest_block) * tb
        else:
            weights(actor, 1)
            for name in sizing.trained:  # the trained components' trainable part, this rank's share of it
                numel = sizing.components[name]
                actor[f"weights/{name}"] = numel * (trained_numel - trainable + per_rank) // trained_numel * wb
        if sizing.lora:
            actor["adapters (fp32 master)"] = trainable * tb
        actor["gradients"] = per_rank * tb
        actor["optimizer (AdamW)"] = 2 * per_rank * tb
    else:
        weights(actor, shard)
        if sizing.lora:
            actor["adapters (fp32 master)"] = trainable * tb // shard
        actor["gradients"] = trainable * tb // shard
        actor["optimizer (AdamW)"] = 2 * trainable * tb // shard
    if uses_reference and not sizing.lora and run.reference == "actor":
        # an engine with its own layout keeps its initial shards frozen (and frees the module's copy)
        actor["reference copy"] = per_rank * wb if model_parallel and engine.keeps_model else trained_numel * wb
    if ema:
        actor["EMA copy"] = trainable * tb // (1 if model_parallel else shard)
    if sharded and sizing.largest_block:
        actor["fsdp2 gathered blocks"] = 2 * sizing.largest_block * wb
    groups = []
    notes = list(sizing.notes)
    if degrees:
        notes.append(f"parallel degrees of train engine '{engine.name}' over {ranks} rank{'s' * (ranks != 1)}: "
                     f"{degrees_text(degrees)}")
    if export:
        where = f"in host memory ({host_model / GIB:.2f} GiB a rank, not on the device)" if host_model else \
            "whole on every rank"
        notes.append(f"{engine.name} keeps the model's module {where} and gathers the shards into it after each "
                     f"optimizer step: weight export {export / GIB:.2f} GiB (after the backward, so it takes turns "
                     f"with the training activations {train_act / GIB:.2f} GiB)")
    if split:
        rollout: dict[str, int] = {}
        weights(rollout, 1)
        if sizing.lora:
            rollout["adapters (fp32 master)"] = trainable * tb
        if export:
            actor["activations (train) or weight export"] = max(train_act, export)
        else:
            actor["activations (train)"] = train_act
        rollout["activations (largest phase)"] = max(rollout_act, decode)
        groups += [GroupPlan("actor", ranks, actor), GroupPlan("rollout", 1, rollout, [phases])]
    else:
        # one worker rolls out and trains in turn: the larger activation peak counts
        actor["activations (largest phase)"] = max(train_act, rollout_act, decode, export)
        groups.append(GroupPlan("actor+rollout", 1, actor, [phases]))
    if uses_reference and run.reference == "separate":
        reference = {f"weights/{c}": sizing.components[c] * wb for c in sizing.trained}
        reference["activations/reference"] = rollout_act
        groups.append(GroupPlan("reference", 1, reference))
    if split and not sharded and not model_parallel and ranks > 1:
        notes.append(f"train engine '{resolved.train_engine.name}' does not shard: every one of the {ranks} "
                     "ranks holds everything")
    if device_type == "cpu":
        groups[1 if split else 0].rows["samples of a step (outputs, trajectories)"] = rollout_state_bytes(cfg)["total"]
    else:
        _host_rows(groups, sizing, cfg, split, trainable * tb)
    preset = cfg.model.preset
    if preset is not None and sizing.preset != preset:
        notes.insert(0, f"these are the released, full-size {resolved.model.name}'s numbers, not the preset "
                     f"'{preset}' this run loads: the model's plugin describes only the released architecture to the "
                     "planner (ModelSizing.preset), so the preset's own memory is not planned")
    elif preset is not None:
        notes.insert(0, f"architecture: the preset '{preset}' this run loads (not the released model)")
    plan = MemoryPlan(groups, device_memory, dtype, notes, memory_source=memory_source,
                      architecture=sizing.preset or "released", shared=device_type == "cpu", parallel=degrees)
    if suggest and device_memory is not None and not plan.fits:
        plan.fixes, plan.tried = _fixes(resolved, sizing, device_memory, device_type)
    return plan


def _host_rows(groups: list[GroupPlan], sizing: ModelSizing, cfg: RunConfig, split: bool, trained_bytes: int) -> None:
    """Each group's host memory beside its device: the encoders ``model.offload: cpu`` keeps there (every worker that
    holds the whole model), a step's samples on the rollout's worker (they wait in its node's object store for the
    update), and with a separate rollout worker the CPU copy of the trained weights each sync moves (every train
    rank gathers them whole: ``trained_state``; the rollout worker receives them)."""
    wb = DTYPE_BYTES[model_dtype(cfg)]
    offloaded = {f"weights/{name} (offloaded)": sizing.components[name] * wb
                 for name in sizing.encoders if cfg.model.offload == "cpu"}
    for group in groups:
        if group.name == "reference":
            continue
        group.host.update(offloaded)
        if group.name in ("rollout", "actor+rollout"):
            group.host["samples of a step (outputs, trajectories)"] = rollout_state_bytes(cfg)["total"]
        if split:
            group.host["trained weights, CPU copy (weight sync)"] = trained_bytes


def _candidates(resolved: ResolvedRun, sizing: ModelSizing, device_type: str | None = None
                ) -> list[tuple[str, dict[str, Any]]]:
    """Single changes that lower memory, as (``--set`` text, patch of the config dump); on the CPU an offload to
    the host moves nothing."""
    cfg = resolved.config
    dump = resolved.dump()
    out: list[tuple[str, dict[str, Any]]] = []
    if model_dtype(cfg) == "float32":
        out.append(("model.dtype=bfloat16", {"model": {"dtype": "bfloat16"}}))
    options = dump["model"]["options"] or {}
    if sizing.checkpointable and "gradient_checkpointing" in options and not options["gradient_checkpointing"]:
        out.append(("model.options.gradient_checkpointing=true", {"model": {"options": {"gradient_checkpointing": True}}}))
    if cfg.model.offload != "cpu" and sizing.encoders and device_type != "cpu":
        out.append(("model.offload=cpu", {"model": {"offload": "cpu"}}))
    micro = train_micro_batch(cfg)
    while micro > 1:
        micro //= 2
        out.append((f"train.micro_batch_size={micro}", {"train": {"micro_batch_size": micro}}))
    seqs = rollout_batch_size(cfg)
    key = resolved.rollout_engine.batch_option
    while key and seqs > 1:
        seqs = max(1, seqs // 4)
        out.append((f"rollout.options.{key}={seqs}", {"rollout": {"options": {key: seqs}}}))
    out += _degree_candidates(resolved, sizing)
    if not sizing.lora and resolved.train_engine.trains_lora:
        out.append(("model.lora.enabled=true", {"model": {"lora": {"enabled": True}}}))
    group = cfg.rollout.group_size
    while group // 2 >= max(2, resolved.algorithm.min_group_size):
        group //= 2
        out.append((f"rollout.group_size={group}", {"rollout": {"group_size": group}}))
    prompts = cfg.rollout.prompts_per_step
    while prompts > 1:
        prompts //= 2
        out.append((f"rollout.prompts_per_step={prompts}", {"rollout": {"prompts_per_step": prompts}}))
    return out


def _degree_candidates(resolved: ResolvedRun, sizing: ModelSizing) -> list[tuple[str, dict[str, Any]]]:
    """Other tensor / expert / sequence parallel degrees of the train engine: each one that divides the ranks and
    what it splits, other than the configured one."""
    run = resolved.config.run
    ranks = run.train_workers if run.executor == "ray" and run.placement == "split" else 1
    options = resolved.dump()["train"]["options"] or {}
    out: list[tuple[str, dict[str, Any]]] = []
    for kind, option in resolved.train_engine.parallel.items():
        units = sizing.parallel_units.get(kind)
        if kind not in (*PARALLEL_SPLITS, "sequence") or not option or units is None:
            continue
        current = options.get(option) or ranks
        for degree in range(1, ranks + 1):
            if degree != current and ranks % degree == 0 and units[0] % degree == 0:
                out.append((f"train.options.{option}={degree}", {"train": {"options": {option: degree}}}))
    return out


def _replan(resolved: ResolvedRun, sizing: ModelSizing, device_memory: int, device_type: str | None,
            patch: dict[str, Any]) -> MemoryPlan | None:
    """The plan of ``resolved`` with ``patch`` (a part of the config dump) applied; None when the change does not
    validate."""
    from omnirl_core.config import RunConfig, deep_merge

    changed = copy.copy(resolved)
    try:
        dump = deep_merge(resolved.config.model_dump(mode="json"), patch)
        changed.config = RunConfig.model_validate(dump)
        changed.options = dict(resolved.options)
        model_options = resolved.options.get("model.options")
        if model_options is not None and "options" in patch.get("model", {}):
            changed.options["model.options"] = model_options.model_copy(update=patch["model"]["options"])
        train_options = resolved.options.get("train.options")
        if train_options is not None and "options" in patch.get("train", {}):
            changed.options["train.options"] = train_options.model_copy(update=patch["train"]["options"])
        resized = sizing
        if {"lora", "dtype"} & set(patch.get("model", {})) and resolved.model.sizing:
            resized = load_sizing(changed)  # another trainable set or dtype: the model describes it anew
        return plan_memory(changed, device_memory, resized, suggest=False, device_type=device_type)
    except Exception:  # noqa: BLE001 - a candidate that does not validate is simply not offered
        return None


def _fixes(resolved: ResolvedRun, sizing: ModelSizing, device_memory: int, device_type: str | None = None
           ) -> tuple[list[tuple[str, int]], list[str]]:
    """Each candidate alone, then all of them together (one at a time in order until it fits); returns the
    changes that fit and every change tried."""
    from omnirl_core.config import deep_merge

    def replan(patch: dict[str, Any]) -> MemoryPlan | None:
        return _replan(resolved, sizing, device_memory, device_type, patch)

    fixes: list[tuple[str, int]] = []
    chosen: dict[str, tuple[str, dict[str, Any]]] = {}  # by setting: the latest value wins
    candidates = _candidates(resolved, sizing, device_type)
    for text, patch in candidates:
        alone = replan(patch)
        if alone is not None and alone.fits:
            fixes.append((text, alone.peak))
            continue
        if alone is None:
            continue
        chosen[text.split("=")[0]] = (text, patch)
        combined: dict[str, Any] = {}
        for _, p in chosen.values():
            combined = deep_merge(combined, p)
        together = replan(combined)
        if not fixes and together is not None and together.fits:
            fixes.append((" ".join(f"--set {t}" for t, _ in chosen.values()), together.peak))
            break
    return fixes[:6], [text for text, _ in candidates]


def check_fits(plan: MemoryPlan, where: str) -> None:
    """Refuse a plan that does not fit, with the numbers and the changes that would make it fit (or, when none
    of those tried does, which were tried)."""
    if plan.fits:
        return
    largest = max(plan.groups, key=lambda g: g.total)
    top = sorted(largest.rows.items(), key=lambda kv: -kv[1])[:4]
    memory = f"{_amount(plan.device_memory or 0)}{plan._source}"
    label = (f"all worker groups together (on one memory): {plan.peak / GIB:.1f} GiB" if plan.shared and plan._several
             else f"{largest.name}: {largest.total / GIB:.1f} GiB per device")
    details = [f"  {label} > budget {(plan.budget or 0) / GIB:.1f} GiB ({memory} less {HEADROOM:.0%} headroom); "
               f"largest rows{' of ' + largest.name if plan.shared and plan._several else ''}: "
               + ", ".join(f"{k} {v / GIB:.1f}" for k, v in top)]
    if plan.fixes:
        details += [f"  fits with --set {text}: {peak / GIB:.1f} GiB" if not text.startswith("--set")
                    else f"  fits with {text}: {peak / GIB:.1f} GiB" for text, peak in plan.fixes]
        hint = ("Apply one of the changes above (see `omnirl plan` for the whole table), use more or larger devices "
                "(run.train_workers with the fsdp2 engine), or give the real size with --device-memory.")
    else:
        tried = ", ".join(plan.tried) or "none applies to this run"
        details.append(f"  no single change omnirl tries fits, nor all of them together (tried: {tried})")
        hint = ("Lower the resolution (rollout.height / rollout.width) or the samples per step, use more or larger "
                "devices (run.train_workers with the fsdp2 engine), or give the real size with --device-memory.")
    room = f"the {memory}" if plan.memory_source else f"{memory} per device"
    raise ConfigError(f"{where} does not fit in {room}.", details=details, hint=hint)
