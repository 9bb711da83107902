"""Run configuration: pydantic models, recipe layering and ``--set`` overrides.

Layers, lowest first: field defaults, the model's and the algorithm's suggested values, a recipe YAML,
command-line flags, ``--set a.b=value``. Unknown keys are errors with a did-you-mean, and every problem of
one config is reported together with its path. Each plugin owns the ``options`` namespace of its section,
validated against the plugin's own pydantic class.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from omnirl_core.errors import ConfigError, did_you_mean


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    enabled: bool = Field(True, description="Train a LoRA adapter (False: full fine-tuning).")
    rank: int = Field(16, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    target_modules: list[str] | None = Field(
        None, description="Module names to adapt; None takes the model plugin's default targets."
    )
    init: Literal["default", "gaussian"] = Field(
        "default", description="Adapter initialisation (B is zero either way, so training starts at the base "
        "model): default, peft's Kaiming-uniform A; gaussian, A ~ N(0, 1/rank) (flow_grpo's choice)."
    )

    @property
    def peft_init(self) -> bool | str:
        """The value of peft's ``init_lora_weights``."""
        return True if self.init == "default" else self.init


class ModelSection(Section):
    name: str = Field("", description="Model component name, e.g. 'qwen-image' (or 'plugin:name').")
    preset: str | None = Field(None, description="Build a preset (e.g. 'tiny': random weights, built locally).")
    path: str | None = Field(None, description="Local directory or hub id; None takes the model's default.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model weights dtype; auto: bfloat16 on an accelerator, float32 on the CPU. Sampler "
        "math and log-probs stay float32, and LoRA adapters keep a float32 master copy, whatever the weights."
    )
    offload: Literal["none", "cpu"] = Field(
        "none", description="Frozen components used only before and after the trained network (text encoders, "
        "VAE): 'none' keeps them on the device, 'cpu' keeps them in host memory and moves each to the device only "
        "while it runs (encoding a prompt, decoding a sample)."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings.")
    compile: bool = Field(False, description="torch.compile (inductor) the trained network's forward, for the rollout "
                          "and the update alike (one graph for every batch size). It pays once the run is long "
                          "against the compile time (minutes on a CPU: benchmarks/README.md); off by default.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the model plugin.")


class AlgorithmSection(Section):
    name: str = Field("", description="Algorithm component name, e.g. 'flowgrpo'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the algorithm plugin.")


class RolloutSection(Section):
    engine: str = Field("diffusers", description="Rollout engine component.")
    prompts_per_step: int = Field(4, ge=1, description="Distinct prompts per training step (B).")
    group_size: int = Field(8, ge=1, description="Samples per prompt (G).")
    num_steps: int = Field(10, ge=2, description="Denoising steps per sample (at least 2: one SDE step and the "
                           "last one, which is deterministic).")
    height: int = Field(512, ge=8, description="Image height in pixels.")
    width: int = Field(512, ge=8, description="Image width in pixels.")
    num_frames: int | None = Field(None, ge=1, description="Frames for video models; None for images.")
    guidance_scale: float = Field(1.0, ge=1.0, description="CFG scale; 1.0 turns CFG off (one branch).")
    negative_prompt: str = Field(" ", description="Negative prompt of the unconditional CFG branch.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the rollout engine.")


class TrainSection(Section):
    engine: str = Field("torch", description="Training engine component.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A NaN/inf loss or gradient, found before the optimizer step: 'stop' the run (the "
        "weights untouched, the last checkpoint intact) or 'skip' that minibatch's step (counted).",
    )
    minibatches: int = Field(1, ge=1, description="Optimizer steps per training step (batch split).")
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Transitions per forward/backward call: a memory setting, not part of the math (a "
        "minibatch's gradient is the same sum however it is split). auto: a rank's whole minibatch in one call when "
        "the memory plan fits it on the device, else the largest half, quarter, ... that does.")
    old_logprob: Literal["recompute", "bypass"] = Field(
        "recompute",
        description="Old log-probs: recompute with the pre-update weights, or take the rollout's (bypass).",
    )
    rs_band: tuple[float, float] | None = Field(
        (0.5, 2.0),
        description="Rollout correction: a sample whose sequence IS weight exp(delta) (trainer vs rollout "
        "log-prob) falls outside [low, high] gets loss weight 0; None turns the mask off.",
    )
    rs_aggregate: Literal["mean", "sum"] = Field(
        "mean", description="Sequence IS weight from the mean or the sum of the per-step log-prob deltas."
    )
    rs_fallback: float | None = Field(
        0.05, ge=0, le=1,
        description="Bypass mode: switch to recompute for the rest of the run when the RS mask's rejected "
        "fraction stays above this for rs_fallback_steps steps; None never switches.",
    )
    rs_fallback_steps: int = Field(3, ge=1, description="Consecutive steps above rs_fallback before switching.")
    cfg_grad: Literal["cond", "both"] = Field(
        "cond", description="True CFG in the training forward: the gradient through the conditional branch only, "
        "the unconditional one detached (cond: half the backward; flow_grpo's train_sd3.py detaches it too), or "
        "through both (both: one batched call with grad; the exact gradient of the guided log-prob).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the training engine.")


class RewardEntry(Section):
    name: str = Field(..., description="Reward component name.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight in the summed reward (finite; 0 logs it "
                          "without training on it).")
    required: bool = Field(True, description="A failing required reward fails the step; an optional one is logged.")
    advantage: Literal["joint", "own"] = Field(
        "joint", description="joint: the reward enters the weighted sum whose group advantage is taken; own: its "
        "advantage is group-normalised on its own and added times its weight (DanceGRPO's sum of per-reward "
        "advantages, GDPO), so a reward on a small scale is not drowned by one on a large scale.")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the reward plugin.")


class TrackerEntry(Section):
    name: str = Field(..., description="Tracker component name, e.g. 'tensorboard' or 'wandb' (see `omnirl list trackers`).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options owned by the tracker plugin.")


class DataSection(Section):
    prompts: str | list[str | dict[str, Any]] | None = Field(
        None, description="Training prompts: a .txt (one per line), .jsonl, .json, .csv/.tsv or .parquet file, a "
        "saved Hugging Face dataset directory, hf:NAME (datasets.load_dataset), builtin:NAME (a shipped set: "
        "colors, text, counting, composition) or a list; None takes the first reward's suggested prompts."
    )
    test_prompts: str | list[str | dict[str, Any]] | None = Field(
        None, description="Held-out prompts (any source data.prompts takes); None: the test split of "
        "data.prompts, if it has one."
    )
    prompt_column: str = Field("prompt", min_length=1, description="The column (record key) holding the prompt.")
    split_column: str = Field("split", min_length=1, description="A column naming each record's split; records "
                              "with it are split by its value (data.train_split / data.test_split).")
    train_split: str = Field("train", description="Name of the training split (a dataset's split or a value of "
                             "the split column).")
    test_split: str = Field("test", description="Name of the held-out split (a dataset's split or a value of the "
                            "split column).")
    test_fraction: float = Field(0.0, ge=0, lt=1, description="Hold out this fraction of the distinct prompts as "
                                 "the test split (chosen with data.split_seed) when the data has no split; 0: none.")
    split_seed: int = Field(0, description="Seed of the data.test_fraction split (the same seed, the same split).")
    dataset_config: str | None = Field(None, description="Configuration name for hf:NAME datasets.")


RAY_RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Ray resources a worker group's ``resources`` may not name: CPUs and devices come from ``run.worker_cpus`` and the
device, memory is not reserved per group, and a node is picked with ``node``."""


class RayPoolConfig(Section):
    """Where one worker group's Ray actors go (``run.ray_pools.<group>``): one placement group per worker group."""

    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="How the group's workers spread over nodes (Ray's placement-group strategies): pack "
        "(as few nodes as possible), spread (as many as possible), strict_pack (all on one node, or fail), "
        "strict_spread (each worker on a node of its own, or fail: FSDP2 ranks over several nodes).")
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="Custom Ray resources each worker of the group reserves; only the nodes "
        "that have them (`ray start --resources '{\"rollout\": 1}'`) take the group. 0.001 selects those nodes "
        "without counting against what they have.")
    node: str | None = Field(
        None, description="Put every worker of the group on one node: its IP address (Ray's node:<ip> resource) "
        "or 'head'. On a machine that runs several Ray nodes they share its IP: select with resources instead.")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        reserved = sorted(k for k in value if k in RAY_RESERVED_RESOURCES or k.startswith("node:"))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be selected here: CPUs come from run.worker_cpus, devices "
                             "from run.device, and a node is picked with 'node'")
        return value


class RewardServeConfig(Section):
    """run.reward_serve: the Ray Serve deployment of the rewards (``run.reward_serving=serve``)."""

    min_replicas: int = Field(1, ge=1, description="Replicas the deployment keeps however idle (each one a "
                              "process holding the run's rewards, with the resources they declare).")
    max_replicas: int | None = Field(
        None, ge=1, description="Replicas it may scale up to while requests queue; None: run.reward_workers. "
        "Equal to min_replicas: a fixed count, no autoscaling.")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Autoscaling: the requests (one sample each) in flight or queued per replica that "
        "Serve aims at; more for upscale_delay_s adds a replica, fewer for downscale_delay_s removes one.")
    max_ongoing_requests: int = Field(
        32, ge=1, description="Requests one replica holds at once (the rest queue at the driver's handle, where "
        "the autoscaler counts them); at least max_batch_size.")
    max_batch_size: int = Field(
        16, ge=1, description="Dynamic batching: the most samples one scoring call of a replica takes. Only rewards "
        "that are all batch_invariant are batched across requests (or every reward with run.reward_batching); "
        "others score each sample in a call of its own.")
    batch_wait_s: float = Field(
        0.01, ge=0, description="Dynamic batching: how long a replica waits for more samples before it scores a "
        "batch that is not full.")
    upscale_delay_s: float = Field(30.0, ge=0, description="Autoscaling: how long the queue must stay above the "
                                   "target before a replica is added.")
    downscale_delay_s: float = Field(600.0, ge=0, description="Autoscaling: how long it must stay below before "
                                     "one is removed.")

    @field_validator("max_batch_size")
    @classmethod
    def _a_batch_fits_a_replica(cls, value: int, info: ValidationInfo) -> int:
        held = info.data.get("max_ongoing_requests")
        if held is not None and value > held:
            raise ValueError(f"{value} is more than max_ongoing_requests ({held}): a replica could never fill a "
                             "batch; raise max_ongoing_requests")
        return value

    @field_validator("max_replicas")
    @classmethod
    def _at_least_min(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("min_replicas")
        if value is not None and low is not None and value < low:
            raise ValueError(f"{value} is less than min_replicas ({low})")
        return value


class RunSection(Section):
    steps: int = Field(100, ge=1, description="Training steps.")
    seed: int = Field(0, description="Seed of prompts, noise and initialisation.")
    output_dir: str | None = Field(None, description="Run directory; None makes runs/<model>-<algo>-<time>.")
    device: str = Field("auto", description="Device plugin name, or 'auto' (the best available).")
    executor: Literal["inline", "ray"] = Field(
        "inline", description="Where worker groups run: 'inline' (this process, threads) or 'ray' (Ray actors)."
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join: 'auto' (the cluster this machine's Ray runs) or HOST:PORT (its GCS). "
        "None: the cluster RAY_ADDRESS names, else a local Ray instance. Not ray:// (Ray Client cannot stream a "
        "rollout): run the driver on a node of the cluster, or submit it as a Ray job."
    )
    ray_pools: dict[Literal["train", "rollout", "reference", "reward"], RayPoolConfig] = Field(
        default_factory=dict, description="Ray: where each worker group's actors go (train, rollout, reference, "
        "reward): a placement strategy and the nodes that may take them (custom resources or a node's address). "
        "A group without an entry packs its workers anywhere.",
    )
    storage: str | None = Field(
        None, description="Ray: where the train ranks write their checkpoint files (shards, optimizer state, the "
        "gathered weights, the algorithm's state) themselves: a local path that every node mounts at the same place, "
        "or an fsspec URI (s3://bucket/runs/x; needs fsspec and the scheme's package on every node). The run "
        "directory's checkpoint then records where they are, with their checksums. None: they reach the run "
        "directory through Ray.",
    )
    placement: Literal["colocated", "split"] = Field(
        "colocated",
        description="Ray: actor and rollout in one worker (no weight copy), or in separate workers (weights "
        "synced after each update).",
    )
    reference: Literal["actor", "separate"] = Field(
        "actor",
        description="Where the reference policy (KL term) is evaluated: in the actor (LoRA disabled, or a frozen "
        "copy for full fine-tuning) or in a separate reference worker (the actor then keeps no copy).",
    )
    train_workers: int = Field(
        1, ge=1, description="Ray: training ranks (a torch.distributed group; >1 needs placement 'split' and a "
        "distributed train engine such as fsdp2)."
    )
    worker_cpus: float = Field(
        1.0, gt=0, description="Ray: CPUs each actor/rollout worker reserves (fractions share a small machine)."
    )
    ray_worker_niceness: int | None = Field(
        0, ge=0, le=19,
        description="Ray: the niceness of omnirl's actors. Ray's own default, 15, lets every other process on the "
        "node run first: a node that is busy with anything else starves the rollout, the update and the rewards. "
        "0 runs them as the driver runs; None keeps Ray's setting.",
    )
    ray_runtime_envs: dict[Literal["train", "rollout", "reference", "reward"], dict[str, Any]] = Field(
        default_factory=dict,
        description="Ray: a runtime environment per worker group (train, rollout, reference, reward), Ray's "
        "runtime_env keys: py_executable (another interpreter), pip or uv (packages Ray installs for the group), "
        "env_vars, working_dir or py_modules (code Ray ships to the group's nodes; plugins as wheels, so that the "
        "version check at start sees their versions); or environment: NAME, the interpreter of an environment "
        "`omnirl env build NAME` built. The group's interpreter must have omnirl and the run's plugins, at the "
        "driver's versions. (Engines with their own environments, "
        "vllm and vllm-omni, start their servers there by themselves, inline and under Ray alike.)",
    )
    reward_mode: Literal["async", "sync"] = Field(
        "async",
        description="async: each finished sample is scored at once, overlapping the rest of the rollout; sync: "
        "the whole batch is scored after the rollout.",
    )
    rollout_threads: int | None = Field(
        None, ge=1,
        description="Inline, CPU device, async rewards: torch threads of the rollout while rewards run beside it; "
        "None: the CPU count torch uses minus the CPUs the rewards declare (per reward worker), at least 1.",
    )
    reward_workers: int = Field(
        1, ge=1, description="Reward workers: threads (inline) or Ray actors in the reward pool (ray). One serves "
        "most runs (batched or concurrent calls, reward_concurrency); each Ray actor is a process that takes CPU "
        "time even when idle, so add more only for rewards that need the CPUs or devices of their own.",
    )
    reward_batching: bool = Field(
        False, description="async: a reward worker that frees up scores every sample that finished meanwhile (its "
        "fair share) in one call, instead of one call per sample: far cheaper for a learned reward's batched "
        "forward; which samples share a call then depends on timing. Always on when every reward of the run is "
        "batch_invariant (scores each sample on its own: color, jpeg, answer-match).",
    )
    reward_concurrency: int = Field(
        1, ge=1, description="Calls each reward worker serves at once (threads): raise it for rewards that wait "
        "on I/O rather than adding reward processes. On Ray, rewards that judge on their own loop (submit, e.g. "
        "vlm-judge) are not bound by it: their own requests in flight are.",
    )
    reward_serving: Literal["actors", "serve"] = Field(
        "actors", description="Ray: how the reward workers run. actors: run.reward_workers Ray actors in the reward "
        "pool; serve: a Ray Serve deployment (replicas on the reward pool's nodes, dynamic batching, replicas "
        "added while requests queue: run.reward_serve), called through its handle inside the cluster (no HTTP).",
    )
    reward_serve: RewardServeConfig = Field(
        default_factory=RewardServeConfig, description="Ray, run.reward_serving=serve: replicas, autoscaling and "
        "dynamic batching of the rewards' Serve deployment.")
    threads: Annotated[Annotated[int, Field(ge=1)] | Literal["adaptive", "fixed"],
                       BeforeValidator(lambda v: "adaptive" if v is None else v)] = Field(
        "adaptive", description="CPU threads of torch's compute in each worker process. 'adaptive' (default): "
        "every core this process may use (affinity and cgroup quota; fewer if OMP_NUM_THREADS says so) at most, "
        "one fewer while its threads wait for a CPU much of the time (a machine other jobs load), re-judged at "
        "each step; the count then follows the load, and floating-point sums with it, so a run is reproducible "
        "bit for bit only with a fixed count: 'fixed' (every core this process may use, always) or a number; "
        "null (configs of earlier versions): the default. See omnirl_core.host.threads.",
    )
    reward_timeout_s: float | None = Field(
        600.0, gt=0, description="Deadline of one reward call (a batch of samples), in seconds: "
        "past it the call fails (a required reward fails the step, an optional one is dropped); None: no deadline.",
    )
    reward_max_failed_steps: int = Field(
        3, ge=1, description="An optional reward that fails on every sample for this many steps in a row stops "
        "the run (rather than training without it unnoticed).",
    )
    save_every: int = Field(50, ge=1, description="Checkpoint every N steps (and at the end).")
    sample_every: int = Field(10, ge=1, description="Save a sample grid every N steps.")
    trackers: list[TrackerEntry] = Field(
        default_factory=list, description="Experiment trackers that receive every step's metrics and sample grids "
        "(metrics.jsonl is always written); a failing tracker is logged, never fails the run."
    )
    eval_every: int | None = Field(
        None, ge=1, description="Evaluate on the test split every N steps (and at the last step): the ODE sampler, "
        "fixed seeds, every reward; logged as eval/* in the step's metrics row. None: off."
    )
    eval_prompts: int | None = Field(
        32, ge=1, description="During training, evaluate on the first N test prompts (None: all of them)."
    )
    eval_samples: int = Field(2, ge=1, description="Samples per test prompt in an evaluation during training "
                              "(seeds fixed for the whole run).")
    eval_steps: int | None = Field(
        None, ge=1, description="Denoising steps of the evaluation's ODE sampler, during training and in omnirl "
        "eval / sample (None: rollout.num_steps; flow_grpo evaluates with 40)."
    )


    @field_validator("reward_serving")
    @classmethod
    def _serve_on_ray(cls, value: str, info: ValidationInfo) -> str:
        if value == "serve" and info.data.get("executor") == "inline":
            raise ValueError("needs run.executor=ray: Ray Serve runs the rewards on a Ray cluster; the inline "
                             "executor scores on threads of its own process")
        return value

    @field_validator("storage")
    @classmethod
    def _storage_on_ray(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("executor") == "inline":
            raise ValueError("needs run.executor=ray: the inline executor's worker is the driver, which writes its "
                             "checkpoints into the run directory")
        if value is not None and not value.strip():
            raise ValueError("an empty location; leave it unset to keep checkpoints in the run directory")
        return value


class RunConfig(Section):
    model: ModelSection = Field(default_factory=ModelSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    rewards: list[RewardEntry] = Field(default_factory=list)
    data: DataSection = Field(default_factory=DataSection)
    run: RunSection = Field(default_factory=RunSection)


_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


# -- layering -------------------------------------------------------------------------------------

def _is_patch(value: object) -> bool:
    """A list patch: what ``--set rewards.0.options.scale=2`` makes (a dict keyed by list indices)."""
    return isinstance(value, dict) and bool(value) and all(isinstance(k, int) for k in value)


def _listify(value: object, path: str) -> Any:
    """A list patch with nothing beneath it becomes a list (indices must then be 0..n-1)."""
    if isinstance(value, dict):
        if _is_patch(value):
            if sorted(value) != list(range(len(value))):
                raise ConfigError(f"{path}: list indices {sorted(value)} leave gaps (the list is empty below).",
                                  hint=f"Set {path}.0 first, then {path}.1, ...")
            return [_listify(value[i], f"{path}.{i}") for i in range(len(value))]
        return {k: _listify(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    return copy.deepcopy(value)


def deep_merge(base: dict[str, Any], override: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``: dicts merge; a list patch (``--set rewards.0.weight=2``)
    changes the items it names and keeps the rest; anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        where = f"{path}.{key}" if path else str(key)
        current = out.get(key)
        if _is_patch(value) and isinstance(current, list):
            items = list(current)
            for index in sorted(value):
                if index < len(items):
                    item, patch = items[index], value[index]
                    items[index] = (deep_merge(item, patch, f"{where}.{index}")
                                    if isinstance(item, dict) and isinstance(patch, dict)
                                    else _listify(patch, f"{where}.{index}"))
                elif index == len(items):
                    items.append(_listify(value[index], f"{where}.{index}"))
                else:
                    raise ConfigError(f"{where}.{index}: index out of range ({where} has {len(items)} item(s)).",
                                      hint=f"Indices of {where} start at 0; append with {where}.{len(items)}.")
            out[key] = items
        elif isinstance(value, dict) and isinstance(current, dict) and not _is_patch(value):
            out[key] = deep_merge(current, value, where)
        else:
            out[key] = _listify(value, where)
    return out


def load_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Recipe '{path}' not found.", hint="Pass an existing YAML file to --recipe.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"Recipe '{path}' is not valid YAML.", details=[str(exc)]) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"Recipe '{path}' must be a mapping at the top level, not {type(data).__name__}.")
    return data


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"Bad --set '{item}': expected KEY=VALUE.", hint="Example: --set train.lr=3e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads '3e-4' (no dot) as a string
        set_path(out, key.strip(), value)
    return out


def set_path(tree: dict[str, Any], dotted: str, value: object) -> None:
    """Set ``a.b.0.c`` in a tree of dicts; a numeric part is a list index (kept as an int key: a list patch
    that ``deep_merge`` applies to the list beneath)."""
    parts = [int(p) if p.isdigit() else p for p in dotted.split(".")]
    node: Any = tree
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[parts[-1]] = value


def get_path(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if isinstance(node, list) or isinstance(node, dict) and part.isdigit() and int(part) in node:
            node = node[int(part)]
        else:
            node = node[part]
    return node


# -- validation -----------------------------------------------------------------------------------

def _fields_at(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names valid at ``loc`` (for did-you-mean on an unknown key)."""
    cls: Any = model_cls
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if cls is None:
            for arg in getattr(ann, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    cls = arg
    return list(getattr(cls, "model_fields", {})) if cls is not None else []


_SECRET_NAME = re.compile(r"key|token|secret|password|passwd|credential|auth", re.IGNORECASE)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def validation_problems(exc: ValidationError, model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(loc))
        if err["type"] == "extra_forbidden":
            hint = did_you_mean(str(loc[-1]), _fields_at(model_cls, loc[:-1]))
            problems.append(f"  {path}: unknown key.{hint}")
        else:
            shown = "<redacted>" if _SECRET_NAME.search(path) else _short(err.get("input"))
            problems.append(f"  {path}: {err['msg']} (got {shown})")
    return problems


def build_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc, RunConfig)
        raise ConfigError(
            f"Invalid configuration: {len(problems)} problem(s).",
            details=problems,
            hint="Fix the recipe or --set values; `omnirl config show` prints every key with its default.",
        ) from exc


def validate_options(options: dict[str, Any], config_cls: type[BaseModel] | None, path: str) -> BaseModel | None:
    """Validate one plugin's ``options`` namespace; returns the typed options (or None without a schema)."""
    if config_cls is None:
        if options:
            raise ConfigError(
                f"{path}: this plugin takes no options, got {sorted(options)}.",
                hint=f"Remove {path} from the recipe or --set.",
            )
        return None
    try:
        return config_cls.model_validate(options)
    except ValidationError as exc:
        problems = validation_problems(exc, config_cls, path)
        raise ConfigError(
            f"Invalid options for {path}: {len(problems)} problem(s).",
            details=problems,
            hint="See the plugin's options with `omnirl config show` or its README.",
        ) from exc
