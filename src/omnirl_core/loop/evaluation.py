"""Evaluation: a model on held-out prompts, with fixed seeds and the deterministic sampler, scored by every
reward of the run.

Every denoising step is an ODE (Euler) step, so a sample depends only on the weights, the prompt and its
seed; CFG is as the run configures it (``rollout.guidance_scale``). Seeds come from (eval seed, prompt text,
sample number), so two models evaluated on the same prompts see the very same initial noise and their
scores pair up sample by sample: ``compare`` reports the mean difference with its paired standard error.
An autoregressive model samples with its engine's settings and the same fixed seeds.

Beside each reward's score, a reward may declare a quantity to show (``Reward.display_for``: an affine function of
the score, e.g. asr-error's raw CER = 1 - score), written as the metric ``<reward>/<name>`` per sample, per prompt
and overall, and compared like the scores.

Used by ``omnirl eval`` (base model, a checkpoint, or a LoRA directory) and by the controller during training
(``run.eval_every``: the test split, logged as ``eval/*`` in the step's metrics row).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnirl_core.contracts import GenRequest, Reward, RolloutPlan, Sample
from omnirl_core.contracts.reward import ScoreDisplay
from omnirl_core.errors import UsageError
from omnirl_core.rundir.checkpoint import write_atomic

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import ResolvedRun

TOTAL = "reward"
"""The weighted sum of the rewards (what training maximises), beside each reward by name."""
GRID_PROMPTS = 16
"""Prompts shown in an evaluation's image grid (one row each)."""


def ode_plan(num_steps: int) -> RolloutPlan:
    """The deterministic sampler: every step an ODE step, none trained."""
    return RolloutPlan(step_kinds=("ode",) * num_steps, train_steps=())


def eval_steps(cfg: RunConfig) -> int:
    """The evaluation sampler's steps: ``run.eval_steps``, else the rollout's."""
    return cfg.run.eval_steps or cfg.rollout.num_steps


def eval_seed(seed: int, prompt: str, k: int) -> int:
    """The seed of sample ``k`` of ``prompt``: the same whatever the model, the prompt's position or batch."""
    digest = hashlib.sha256(f"omnirl-eval:{seed}:{k}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (2**62)


def reward_displays(resolved: ResolvedRun) -> dict[str, ScoreDisplay]:
    """What each reward of the run shows beside its score (``Reward.display_for`` of its options), by reward
    name; read from the reward's class, so nothing is built (a factory that is a plain function shows none)."""
    out = {}
    for i, (entry, spec) in enumerate(zip(resolved.config.rewards, resolved.rewards)):
        factory = spec.load_factory()
        if isinstance(factory, type) and issubclass(factory, Reward):
            display = factory.display_for(resolved.options.get(f"rewards.{i}.options"))
            if display is not None:
                out[entry.name] = display
    return out


def displayed_metric(reward: str, display: ScoreDisplay) -> str:
    """The metric name of a reward's displayed quantity: ``asr-error/cer``."""
    return f"{reward}/{display.name}"


def eval_requests(records: list[dict[str, Any]], cfg: RunConfig, samples_per_prompt: int,
                  seed: int) -> list[GenRequest]:
    plan = ode_plan(eval_steps(cfg))
    out = []
    for i, record in enumerate(records):
        for k in range(samples_per_prompt):
            s = eval_seed(seed, record["prompt"], k)
            out.append(GenRequest(
                uid=i * samples_per_prompt + k, prompt=record["prompt"], prompt_index=i, group=i, seed=s,
                height=cfg.rollout.height, width=cfg.rollout.width, num_frames=cfg.rollout.num_frames,
                guidance_scale=cfg.rollout.guidance_scale, plan=plan, noise_seed=s,
                inputs={k2: v for k2, v in record.items() if k2 != "prompt"},
            ))
    return out


def _stats(values: list[float]) -> dict[str, float]:
    n = len(values)
    if not n:
        return {"mean": float("nan"), "std": float("nan"), "se": float("nan"), "n": 0}
    std = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "se": std / math.sqrt(n), "n": n}


@dataclass
class EvalResult:
    """One model's scores: a row per sample (prompt, sample number, seed, every reward, the total, and what a
    reward displays beside its score: ``displays``, by metric name)."""

    label: str
    metrics: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    displays: dict[str, tuple[str, ScoreDisplay]] = field(default_factory=dict)
    """``asr-error/cer`` -> (``asr-error``, its ``ScoreDisplay``): the metric is that reward's score displayed."""

    def displayed(self) -> dict[str, dict[str, Any]]:
        """The displayed metrics as ``results.json`` records them: reward, scale, offset, lower_is_better."""
        return {m: {"reward": reward, "scale": d.scale, "offset": d.offset, "lower_is_better": d.scale < 0}
                for m, (reward, d) in self.displays.items()}

    def values(self, metric: str) -> list[float]:
        return [r[metric] for r in self.rows if metric in r and math.isfinite(r[metric])]

    def summary(self) -> dict[str, dict[str, float]]:
        return {m: _stats(self.values(m)) for m in self.metrics}

    def per_prompt(self) -> list[dict[str, Any]]:
        prompts: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows:
            prompts.setdefault(row["prompt"], []).append(row)
        out = []
        for prompt, rows in prompts.items():
            entry: dict[str, Any] = {"prompt": prompt, "samples": len(rows)}
            for m in self.metrics:
                values = [r[m] for r in rows if m in r and math.isfinite(r[m])]
                entry[m] = statistics.fmean(values) if values else float("nan")
            if any("audio" in r for r in rows):  # speech: the prompt's WAV files, to listen beside its scores
                entry["audio"] = [r["audio"] for r in rows if "audio" in r]
            out.append(entry)
        return out

    def flat(self, prefix: str = "eval/") -> dict[str, float]:
        """Metrics-row keys: ``eval/reward/mean``, ``eval/reward/std``, ``eval/reward/se``, ``eval/reward/<name>``,
        ``eval/reward/<name>/se``."""
        summary = self.summary()
        out = {f"{prefix}reward/mean": summary[TOTAL]["mean"], f"{prefix}reward/std": summary[TOTAL]["std"],
               f"{prefix}reward/se": summary[TOTAL]["se"]}
        for m in self.metrics:
            if m != TOTAL:
                out[f"{prefix}reward/{m}"] = summary[m]["mean"]
                out[f"{prefix}reward/{m}/se"] = summary[m]["se"]
        return out


def score_rows(samples: list[Sample], reward_names: list[str], seeds_k: dict[int, int],
               displays: dict[str, ScoreDisplay] | None = None) -> list[dict[str, Any]]:
    rows = []
    displays = displays or {}
    for s in sorted(samples, key=lambda s: s.request.uid):
        row: dict[str, Any] = {"prompt": s.prompt, "sample": seeds_k[s.request.uid], "seed": s.request.seed}
        if s.condition_images:  # an edit: its source, beside its scores
            row["source"] = list(s.condition_images)
        for name in reward_names:
            if name in s.rewards:
                row[name] = float(s.rewards[name])
                if name in displays:
                    row[displayed_metric(name, displays[name])] = displays[name](row[name])
        if s.rewards:
            row[TOTAL] = float(s.reward)
        rows.append(row)
    return rows


def evaluate(generate: Callable[[list[GenRequest]], list[Sample]], records: list[dict[str, Any]], cfg: RunConfig,
             samples_per_prompt: int, seed: int, label: str,
             displays: dict[str, ScoreDisplay] | None = None) -> EvalResult:
    """``generate(requests)`` returns the scored samples (a run's executor, or ``Evaluator``). ``displays``: what
    each reward shows beside its score (``reward_displays``), by reward name."""
    if not records:
        raise UsageError("No prompts to evaluate on.", hint="Give held-out prompts (data.test_prompts, --prompts).")
    requests = eval_requests(records, cfg, samples_per_prompt, seed)
    samples = sorted(generate(requests), key=lambda s: s.request.uid)
    names = [e.name for e in cfg.rewards]
    shown = {n: d for n, d in (displays or {}).items() if n in names}
    result = EvalResult(label=label, metrics=[TOTAL, *names, *(displayed_metric(n, d) for n, d in shown.items())],
                        displays={displayed_metric(n, d): (n, d) for n, d in shown.items()})
    result.rows = score_rows(samples, names, {r.uid: r.uid % samples_per_prompt for r in requests}, shown)
    result.outputs = [s.output for s in samples]
    return result


def compare(base: EvalResult, other: EvalResult) -> dict[str, dict[str, float]]:
    """``other`` minus ``base`` per metric, paired by (prompt, seed): mean difference, its standard error over
    the pairs (``se``) and over per-prompt mean differences (``se_prompt``, which allows for samples of one
    prompt moving together), and z = mean / se."""
    out = {}
    for m in base.metrics:
        a = {(r["prompt"], r["seed"]): r[m] for r in base.rows if m in r and math.isfinite(r[m])}
        b = {(r["prompt"], r["seed"]): r[m] for r in other.rows if m in r and math.isfinite(r[m])}
        keys = sorted(a.keys() & b.keys())
        diffs = [b[k] - a[k] for k in keys]
        stats = _stats(diffs)
        by_prompt: dict[str, list[float]] = {}
        for k, d in zip(keys, diffs):
            by_prompt.setdefault(k[0], []).append(d)
        prompt_stats = _stats([statistics.fmean(v) for v in by_prompt.values()])
        z = stats["mean"] / stats["se"] if stats["n"] > 1 and stats["se"] > 0 else float("nan")
        out[m] = {"base": _stats(list(a.values()))["mean"], "other": _stats(list(b.values()))["mean"],
                  "diff": stats["mean"], "se": stats["se"], "se_prompt": prompt_stats["se"], "z": z,
                  "pairs": stats["n"]}
    return out


def _speech(result: EvalResult, path: Path) -> Path:
    """Every speech sample as a WAV file in the folder ``path`` without its suffix (``trained/0003.wav``), named in
    its row of ``result`` (``audio``, ``seconds``), and the listing ``path`` as JSONL: prompt, seed, the text
    spoken, the file and its scores, a line per sample."""
    from omnirl_core.rundir.audio import write_wav

    folder = path.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for n, (row, speech) in enumerate(zip(result.rows, result.outputs)):
        wav = write_wav(folder / f"{n:04d}.wav", speech)
        row.update(audio=f"{folder.name}/{wav.name}", seconds=round(speech.duration_s, 3))
        scores = {m: row[m] for m in result.metrics if m in row}
        lines.append(json.dumps({"prompt": row["prompt"], "seed": row["seed"], "text": speech.text,
                                 "audio": row["audio"], "seconds": row["seconds"], **scores}, ensure_ascii=False))
    path = path.with_suffix(".jsonl")
    write_atomic(path, "\n".join(lines) + "\n")
    return path


def _grid(result: EvalResult, samples_per_prompt: int, path: Path) -> Path | None:
    """The first GRID_PROMPTS prompts, one row each (PNG; a JSONL file for text outputs); speech: every sample's
    WAV file and a JSONL listing (``_speech``)."""
    from omnirl_core.contracts.data import Speech
    from omnirl_core.rundir.pictures import image_grid

    if result.outputs and all(isinstance(o, Speech) for o in result.outputs):
        return _speech(result, path)
    count = min(len(result.outputs), GRID_PROMPTS * samples_per_prompt)
    outputs, rows = result.outputs[:count], result.rows[:count]
    if not outputs:
        return None
    if all(isinstance(o, str) for o in outputs):
        path = path.with_suffix(".jsonl")
        write_atomic(path, "".join(json.dumps({"prompt": r["prompt"], "seed": r["seed"], "output": o,
                                               "reward": r.get(TOTAL)}, ensure_ascii=False) + "\n"
                                   for r, o in zip(rows, outputs)))
        return path
    import io

    buffer = io.BytesIO()
    sources = [tuple(r.get("source", ())) for r in rows]
    image_grid(outputs, [r["prompt"] for r in rows], samples_per_prompt, sources).save(buffer, format="PNG")
    write_atomic(path, buffer.getvalue())
    return path


def eval_settings(cfg: RunConfig, *, step: int, checkpoint: str | None, weights: str | None, during_training: bool,
                  prompts: str, test_prompts: int, samples: int, seed: int) -> dict[str, Any]:
    """The settings an evaluation's ``results.json`` records, during training and from ``omnirl eval`` alike."""
    return {"step": step, "checkpoint": checkpoint, "weights": weights, "during_training": during_training,
            "prompts": prompts, "test_prompts": test_prompts, "samples_per_prompt": samples, "seed": seed,
            "sampler": "ode", "num_steps": eval_steps(cfg), "guidance_scale": cfg.rollout.guidance_scale,
            "rewards": [f"{e.name} x{e.weight:g}" for e in cfg.rewards]}


def write_results(directory: Path, results: list[EvalResult], settings: dict[str, Any],
                  comparison: dict[str, dict[str, float]] | None = None, samples_per_prompt: int = 1) -> Path:
    """``directory/results.json`` (settings, each model's summary and per-prompt means, every sample's scores,
    the metrics displayed beside a reward's score, the comparison) and ``directory/<label>.png`` grids (speech: ``directory/<label>/NNNN.wav``, every sample,
    listed in ``directory/<label>.jsonl`` and named in the sample rows and per-prompt entries)."""
    directory.mkdir(parents=True, exist_ok=True)
    models = {}
    displayed: dict[str, dict[str, Any]] = {}
    for result in results:
        displayed.update(result.displayed())
        grid = _grid(result, samples_per_prompt, directory / f"{result.label}.png")
        models[result.label] = {"summary": result.summary(), "per_prompt": result.per_prompt(), "samples": result.rows,
                                "grid": grid.name if grid else None}
    data = {**settings, "models": models}
    if displayed:
        data["displayed"] = displayed
    if comparison is not None:
        data["compare"] = comparison
    path = directory / "results.json"
    write_atomic(path, json.dumps(data, indent=2, allow_nan=True) + "\n")
    return path


class Evaluator:
    """A model to evaluate or sample from, outside a training run: one rollout worker (LoRA layout as the run
    trained it) whose weights are the base model's until ``load`` puts a checkpoint's or a LoRA's in."""

    def __init__(self, resolved: ResolvedRun, score: bool = True):
        from omnirl_core.loop.worker import Worker

        self.resolved = resolved
        self.worker = Worker(resolved, {"rollout"})
        self.worker.setup()
        self.displays = reward_displays(resolved) if score else {}
        """What each reward shows beside its score, for ``evaluate(..., displays=)``."""
        self.rewards = None
        if score:
            from omnirl_core.loop.executors import build_rewards

            self.rewards = build_rewards(resolved)
        self.loaded: str = "base"

    def load(self, directory: Path, trained: bool = False) -> None:
        """Trained weights from a checkpoint (verified against its checksums) or a LoRA directory. A checkpoint
        that holds evaluation weights (``eval-weights/``: an algorithm's EMA of the trained weights, as
        FlowGRPO's ``ema`` keeps) gives those, unless ``trained``."""
        from omnirl_core.algorithm import EVAL_WEIGHTS
        from omnirl_core.rundir.checkpoint import CHECKSUMS, stored_entry, verify
        from omnirl_core.rundir.storage import fetch

        if (directory / CHECKSUMS).is_file():
            verify(directory)
        entry = stored_entry(directory) if (directory / CHECKSUMS).is_file() else None
        with tempfile.TemporaryDirectory(prefix="omnirl-eval-") as scratch:
            base = directory
            if entry is not None:  # run.storage: the workers' files, the weights among them, are in the storage
                fetch(entry, sorted(entry["files"]), Path(scratch))  # each checked against its SHA-256
                base = Path(scratch)
            weights = EVAL_WEIGHTS if not trained and (base / EVAL_WEIGHTS).is_dir() else ""
            self._load_from(directory, base / weights if weights else base)
        self.loaded = str(directory / weights if weights else directory)

    def _load_from(self, directory: Path, source: Path) -> None:
        try:
            self.worker.model.load_trained(source)
        except FileNotFoundError as exc:
            raise UsageError(f"'{directory}' holds no trained weights this model reads ({exc}).",
                             hint="Pass a checkpoint directory (checkpoints/step-N) or a LoRA directory with "
                             "pytorch_lora_weights.safetensors.") from None
        except (ValueError, RuntimeError) as exc:
            raise UsageError(f"The weights in '{directory}' do not fit this model: {str(exc)[:300]}",
                             hint="Evaluate with the model, preset and LoRA settings the weights were trained "
                             "with (a run directory's config.yaml has them).") from None

    def generate(self, requests: list[GenRequest], score: bool = True) -> list[Sample]:
        samples = list(self.worker.generate(requests))
        if score and self.rewards is not None:
            self.rewards.score(samples)
        return samples


# -- what the eval and sample commands evaluate --------------------------------------------------------

def run_layers(run_dir: Path) -> dict[str, Any]:
    """A run directory's saved config as the lowest config layer (flags and --set go above it)."""
    from omnirl_core.rundir.rundir import RunDir

    saved = RunDir(run_dir).saved_config()
    if saved is None:
        raise UsageError(f"'{run_dir}' is not an omnirl run directory (no config.yaml).",
                         hint="Pass the --output-dir of a training run, or evaluate a base model with --model.")
    saved.get("run", {}).pop("output_dir", None)
    saved.get("run", {}).pop("trackers", None)  # evaluating watches nothing
    saved.get("run", {}).pop("eval_every", None)
    return saved


def default_algorithm(manager: PluginManager, model_name: str) -> str:
    """An algorithm that fits the model, to complete a config that only evaluates or samples (neither uses it)."""
    from omnirl_core.registry import AlgorithmSpec

    model = manager.resolve("model", model_name)
    fitting = [a.qualified_name for a in manager.registries["algorithm"]
               if isinstance(a, AlgorithmSpec) and a.requires <= model.capabilities]  # the registry's only kind
    if not fitting:
        raise UsageError(f"No installed algorithm works with model '{model.name}'.",
                         hint="Pass --algo NAME (see `omnirl list algos`).")
    return fitting[0]


def find_checkpoint(run_dir: Path | None, checkpoint: str | None) -> Path | None:
    """``--checkpoint``: a path, ``step-N`` or ``N`` (in the run's checkpoints/); None: the run's latest."""
    from omnirl_core.rundir.checkpoint import checkpoints, latest_checkpoint

    if checkpoint is not None:
        path = Path(checkpoint)
        if path.is_dir():
            return path
        if run_dir is not None:
            wanted = checkpoint.removeprefix("step-")
            for step, found in checkpoints(run_dir):
                if wanted.isdigit() and int(wanted) == step:
                    return found
        saved = [p.name for _, p in checkpoints(run_dir)] if run_dir is not None else []
        raise UsageError(f"Checkpoint '{checkpoint}' not found.",
                         hint=f"Checkpoints of the run: {', '.join(saved) or 'none'}; or pass a directory.")
    if run_dir is None:
        return None
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise UsageError(f"Run directory '{run_dir}' has no checkpoint yet.",
                         hint="Evaluate the base model with --base, or train first.")
    return latest


def checkpoint_step(path: Path | None) -> int:
    from omnirl_core.rundir.checkpoint import STEP_DIR

    match = STEP_DIR.fullmatch(path.name) if path is not None else None
    return int(match.group(1)) if match else 0


def eval_records(resolved: ResolvedRun, prompts: str | None, split: str,
                 max_prompts: int | None) -> tuple[list[dict], str]:
    """The prompts to evaluate on and a description. ``split``: ``test`` (the held-out split; all of
    ``prompts`` when that source has none), ``train`` or ``all``."""
    from omnirl_core.data.sources import open_run_data

    cfg = resolved.config
    if prompts is not None:
        cfg.data.prompts = prompts
        cfg.data.test_prompts = None
    data = open_run_data(resolved)
    if split == "train":
        records = data.train
    elif split == "all":
        records = data.train + (data.test or [])
    elif split == "test":
        if data.test is None and prompts is None:
            raise UsageError(f"The run's prompts ({data.source}) have no test split to evaluate on.",
                             hint="Pass held-out prompts with --prompts SOURCE (e.g. --prompts builtin:colors takes "
                             "its test split), or --split train to evaluate on the training prompts.")
        records = data.test if data.test is not None else data.train
    else:
        raise UsageError(f"Unknown --split '{split}'.", hint="Use --split test, train or all.")
    if max_prompts is not None:
        records = records[:max_prompts]
    part = split if split != "test" or data.test is not None else "all"
    return records, f"{data.source} ({part}: {len(records)} prompts)"


def save_samples(samples: list[Sample], out: Path) -> list[dict[str, Any]]:
    """Each output in its own file: PNG (image), GIF (video frames), TXT (text), WAV (speech); returns the index
    rows. An edit (a sample with a source image) also gets ``NNNN-edit.png``: source and result side by side under the
    instruction."""
    from omnirl_core.contracts.data import Speech
    from omnirl_core.rundir.audio import write_wav
    from omnirl_core.rundir.pictures import is_video, side_by_side, to_pil

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, s in enumerate(sorted(samples, key=lambda s: s.request.uid)):
        stem = out / f"{n:04d}"
        assert s.output is not None, "a sample without its output"
        if isinstance(s.output, str):
            path = stem.with_suffix(".txt")
            write_atomic(path, s.output + "\n")
        elif isinstance(s.output, Speech):
            path = write_wav(stem.with_suffix(".wav"), s.output)
        elif is_video(s.output):
            path = stem.with_suffix(".gif")
            frames = [to_pil(s.output[:, f], min_side=1) for f in range(s.output.shape[1])]
            frames[0].save(path, save_all=True, append_images=frames[1:], duration=125, loop=0)
        else:
            path = stem.with_suffix(".png")
            to_pil(s.output, min_side=1).save(path)
        row: dict[str, Any] = {"file": path.name, "prompt": s.prompt, "seed": s.request.seed}
        if s.condition_images and path.suffix == ".png":
            pair = stem.with_name(f"{stem.name}-edit.png")
            side_by_side(s.condition_images[0], s.output, s.prompt).save(pair)
            row.update(source=list(s.condition_images), side_by_side=pair.name)
        rows.append(row)
    write_atomic(out / "samples.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return rows


# -- what `omnirl eval` / `omnirl sample` load ----------------------------------------------------------

def resolve_for_eval(manager: PluginManager, layers: list[dict[str, Any]], run_dir: Path | None, model_given: bool,
                     algo_given: bool) -> ResolvedRun:
    """The resolved config of what eval / sample load: a run directory's config (the given layers on top), or
    a model given by flags (with the model's default algorithm unless one is given: the base model)."""
    from omnirl_core.resolve import resolve_run

    if run_dir is None and not model_given:
        raise UsageError("Nothing to load: give a run directory or --model.",
                         hint="Example: omnirl eval runs/my-run --compare base, or omnirl eval --model qwen-image "
                         "--preset tiny --prompts builtin:colors")
    layers = list(layers)
    if run_dir is not None:
        layers.insert(0, run_layers(run_dir))
    elif not algo_given:
        name = next((layer.get("model", {}).get("name") for layer in layers if layer.get("model")), None)
        if name:
            layers.insert(0, {"algorithm": {"name": default_algorithm(manager, name)}})
    return resolve_run(manager, layers, probe_device=True)


def weights_to_load(run_dir: Path | None, checkpoint: str | None, lora: str | None, base: bool) -> Path | None:
    """The trained weights to load: None for the base model, a LoRA directory, or a run's checkpoint."""
    if sum(bool(x) for x in (checkpoint, lora, base)) > 1:
        raise UsageError("Give one of --checkpoint, --lora and --base.", hint="They name the weights to load.")
    if base:
        return None
    if lora:
        if not Path(lora).is_dir():
            raise UsageError(f"LoRA directory '{lora}' not found.",
                             hint="Pass a directory with pytorch_lora_weights.safetensors.")
        return Path(lora)
    return find_checkpoint(run_dir, checkpoint)


def default_eval_dir(resolved: ResolvedRun) -> Path:
    """Where a base-model evaluation goes when no run directory or --output-dir is given."""
    import time

    return Path("runs") / f"eval-{resolved.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
