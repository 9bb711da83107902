"""omnirl against flow_grpo's own SD3 trainer on identical work, alternating runs, side by side in one run.

    python benchmarks/reference_trainer.py --flow-grpo ~/src/flow_grpo --python ~/venvs/flow-grpo/bin/python
    python benchmarks/reference_trainer.py ... --pairs 3 --steps 17 --threads 2
    python benchmarks/reference_trainer.py ... --prompts pickscore        # flow_grpo's own pickscore prompts
    python benchmarks/reference_trainer.py ... --load 1 --paired-quiet   # degradation beside a busy process

flow_grpo (github.com/yifan123/flow_grpo) is not part of omnirl: bring a checkout and a Python environment that
runs it (torch, diffusers, transformers, peft, accelerate, ml_collections, absl-py, wandb). Its
``scripts/train_sd3.py`` runs unchanged; a small driver started with that Python:
- times each epoch through its ``wandb.log`` calls, with wandb disabled: ``{"epoch": ...}`` once the epoch's
  samples are scored, ``{"actual_batch_size": ...}`` as its training begins, and one with ``inner_epoch`` after
  each optimizer step; the step splits into sampling (end of the previous update to samples scored) and update
  (training begins to the last optimizer step), as omnirl's metrics split it. It ends the run after ``--steps``
  epochs (the script loops forever);
- sets torch's threads to ``--threads``;
- gives peft's model a ``.module`` that is the model itself: train_sd3.py reaches the LoRA model as
  ``transformer.module`` (the DDP wrapper of its multi-GPU launch), which one process does not have.

The work, the same on both sides (written here as flow_grpo's config file and as an omnirl recipe):
- the SD3.5 tiny preset (random weights, medium layout), saved once in the diffusers layout and loaded by both
  through ``StableDiffusion3Pipeline.from_pretrained``;
- 64x64, 10 SDE steps (noise level 0.7), CFG 4.5 with the empty negative prompt, T5 prompts of 128 tokens;
- 16 images per step: 4 prompts x 4 (flow_grpo: 4 batches of 1 prompt x 4 images);
- 9 of the 10 steps trained, 2 optimizer steps per step (flow_grpo: gradient accumulation 2); the training
  forward runs both CFG branches in one batch and detaches the unconditional one: flow_grpo's ``train_sd3.py``
  (``noise_pred_uncond.detach()``) and omnirl's default ``train.cfg_grad: cond`` take the same gradient
  (``--cfg-grad both`` differentiates both branches, more work than flow_grpo does);
- the micro-batch is a memory setting, not part of the math (the gradient is the same sum over a minibatch's
  rows): flow_grpo trains 4 samples x 1 timestep per call, omnirl ``train.micro_batch_size: auto`` (every row of
  a minibatch in one call when the memory plan allows; ``--omnirl-micro N`` fixes it);
- LoRA r 32, alpha 64, gaussian init, on attn.to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out;
- KL beta 0.04 in flow_grpo's convention, PPO clip 1e-4, advantages over the batch std clipped at 5;
- AdamW lr 3e-4, betas (0.9, 0.999), weight decay 1e-4, grad-norm clip 1.0; fp32 (mixed_precision "no");
- JPEG compressibility (-size in kB / 500, quality 95); 8 short prompts (``--prompts short``) or flow_grpo's
  own pickscore prompt files (``--prompts pickscore``, from the checkout); no evaluation, no checkpoints within
  the timed steps (flow_grpo evaluates at epoch 0, before its first timed epoch).

Each run's steps from ``--skip`` + 1 to ``--steps`` are timed (default 3-17 of 17): omnirl's ``time/step_s`` from
its metrics, flow_grpo's time between consecutive epoch stamps (training of one epoch and sampling of the
next), and both split into sampling and update. The pairs alternate which trainer starts. The machine (CPU model,
AVX-512 / AMX flags) is printed and recorded with the figures. Writes ``benchmarks/results/reference_trainer.json``:
per run the step times, the phases, images/s and the load average at its start; per pair the speed ratio and the
update-time ratio; the medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PROMPTS = ['a red apple on a table', 'a shop sign that says "OPEN"', 'a blue car in the rain', 'a cat wearing a hat',
           'a mountain lake at dawn', 'a poster with the word "OMNI"', 'a bowl of ramen', 'a lighthouse at night']
LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                "attn.to_out.0", "attn.to_q", "attn.to_v"]
IMAGES_PER_STEP = 16

FLOW_GRPO_CONFIG = '''\
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("base", os.path.join(os.environ["FLOW_GRPO"], "config", "base.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def get_config():
    c = base.get_config()
    c.pretrained.model = os.environ["FG_MODEL"]
    c.dataset = os.environ["FG_PROMPTS"]
    c.prompt_fn = "general_ocr"  # prompts from <dataset>/train.txt
    c.reward_fn = {"jpeg_compressibility": 1.0}
    c.mixed_precision = "no"
    c.allow_tf32 = False
    c.use_lora = True
    c.resolution = 64
    c.sample.num_steps = 10
    c.sample.eval_num_steps = 10
    c.sample.guidance_scale = 4.5
    c.sample.noise_level = 0.7
    c.sample.train_batch_size = 4
    c.sample.num_image_per_prompt = 4
    c.sample.num_batches_per_epoch = 4
    c.sample.test_batch_size = 4
    c.sample.global_std = True
    c.train.batch_size = 4
    c.train.gradient_accumulation_steps = 2
    c.train.timestep_fraction = 0.99
    c.train.beta = 0.04
    c.train.ema = False
    c.per_prompt_stat_tracking = True
    c.eval_freq = 10 ** 9  # epoch 0 only (0 % n == 0), before the first timed epoch
    c.save_freq = 10 ** 9
    c.logdir = os.environ["FG_LOGDIR"]
    c.save_dir = os.environ["FG_LOGDIR"]
    return c
'''

DRIVER = '''\
import json, os, runpy, sys, time
checkout, config, out, epochs, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
os.environ["WANDB_MODE"] = "disabled"
import torch
torch.set_num_threads(threads)
import peft
import wandb

peft.PeftModel.module = property(lambda self: self)  # train_sd3.py's transformer.module (DDP) in one process
stamps, marks = [], []


def log(data, step=None, **kwargs):
    now = time.perf_counter()
    if "inner_epoch" in data:  # after each optimizer step
        marks.append({"kind": "optimizer_step", "epoch": int(data["epoch"]), "t": now})
    elif "actual_batch_size" in data:  # the epoch's training begins
        marks.append({"kind": "train_start", "t": now})
    elif "epoch" in data:  # once per epoch, after its samples are scored
        stamps.append({"epoch": int(data["epoch"]), "t": now})
        with open(out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "stamps": stamps, "marks": marks}, f)
        if len(stamps) > epochs:
            os._exit(0)


_init = wandb.init


def init(*args, **kwargs):  # wandb.init points wandb.log at its run: ours goes in after it
    run = _init(*args, **kwargs)
    wandb.log = log
    return run


wandb.init = init
os.chdir(checkout)
sys.path[:0] = [checkout, os.path.join(checkout, "scripts")]
sys.argv = ["train_sd3.py", "--config=" + config]
runpy.run_path(os.path.join(checkout, "scripts", "train_sd3.py"), run_name="__main__")
'''


def omnirl_recipe(model: Path, prompts: Path, steps: int, threads: int | str, cfg_grad: str,
                  micro: int | str = "auto") -> dict:
    return {
        "model": {"name": "sd3.5", "path": str(model), "dtype": "float32",
                  "lora": {"enabled": True, "rank": 32, "alpha": 64, "init": "gaussian",
                           "target_modules": LORA_TARGETS},
                  "options": {"layout": "medium", "use_t5": True, "max_sequence_length": 128}},
        "algorithm": {"name": "flowgrpo", "options": {
            "sampler": "sde", "noise_level": 0.7, "clip_range": 1.0e-4, "beta": 0.04, "kl_convention": "flow_grpo",
            "adv_clip": 5.0, "global_std": True}},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "num_steps": 10, "height": 64, "width": 64,
                    "guidance_scale": 4.5, "negative_prompt": ""},
        "train": {"lr": 3.0e-4, "weight_decay": 1.0e-4, "betas": [0.9, 0.999], "max_grad_norm": 1.0,
                  "micro_batch_size": micro, "minibatches": 2, "old_logprob": "bypass", "rs_band": None,
                  "cfg_grad": cfg_grad},
        "rewards": [{"name": "jpeg", "options": {"scale": 0.002, "quality": 95}}],
        "data": {"prompts": str(prompts / "train.txt")},
        "run": {"steps": steps, "device": "cpu", "threads": threads, "save_every": 10_000, "sample_every": 10_000},
    }


def run_omnirl(work: Path, index: str, args) -> dict:
    out = work / f"omnirl-{index}"
    recipe = work / "omnirl.yaml"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    omnirl = Path(sys.executable).with_name("omnirl")  # the CLI a user runs, from this environment
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.omnirl_env)}
    proc = subprocess.run([str(omnirl), "train", "--recipe", str(recipe), "-o", str(out)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise SystemExit(f"omnirl run {index} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r and r["step"] > args.skip]
    phases = {k: statistics.fmean(r[k] for r in rows if r["step"] > args.skip)
              for k in ("time/rollout_s", "time/reward_s", "time/train_s")}
    return {"trainer": "omnirl", "load_avg_1m_at_start": load, "wall_s": time.perf_counter() - t0,
            "step_s": steps, "phases_s": phases, "threads": rows[-1].get("rollout/threads"),
            # the adaptive policy's pool per timed step and the wait share that set it (absent on a fixed pool)
            "torch_threads": [r.get("threads/torch") for r in rows if "time/step_s" in r and r["step"] > args.skip],
            "wait_share": [r.get("threads/wait_share") for r in rows if "time/step_s" in r and r["step"] > args.skip]}


def run_flow_grpo(work: Path, index: str, args) -> dict:
    out = work / f"flow_grpo-{index}.json"
    env = {**os.environ, "FLOW_GRPO": str(args.flow_grpo), "FG_MODEL": str(work / "sd35-tiny"),
           "FG_PROMPTS": str(prompt_dir(work, args)), "FG_LOGDIR": str(work / f"flow_grpo-logs-{index}"),
           "PYTHONPATH": ""}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([str(args.python), str(work / "driver.py"), str(args.flow_grpo),
                           str(work / "flow_grpo_config.py"), str(out), str(args.steps), str(args.threads)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode or not out.exists():
        raise SystemExit(f"flow_grpo run {index} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    t = [s["t"] for s in data["stamps"]]
    # stamp k: epoch k's samples scored; the step between stamps k-1 and k trains epoch k-1 and samples epoch k
    steps = [b - a for a, b in itertools.pairwise(t)][args.skip - 1:args.steps - 1]
    return {"trainer": "flow_grpo", "load_avg_1m_at_start": load, "wall_s": time.perf_counter() - t0,
            "step_s": steps, "phases_s": flow_grpo_phases(data, args.skip), "threads": data["threads"]}


def flow_grpo_phases(data: dict, skip: int) -> dict:
    """flow_grpo's sampling and update times from the driver's marks, averaged over the timed epochs: an epoch's
    update runs from its ``train_start`` to its last optimizer step; its sampling from the previous epoch's last
    optimizer step to its samples being scored (the rewards included, as flow_grpo scores while it samples)."""
    scored = {s["epoch"]: s["t"] for s in data["stamps"]}
    starts = [m["t"] for m in data["marks"] if m["kind"] == "train_start"]
    last_step: dict[int, float] = {}
    for m in data["marks"]:
        if m["kind"] == "optimizer_step":
            last_step[m["epoch"]] = m["t"]
    update = [last_step[e] - starts[e] for e in sorted(last_step) if e < len(starts) and e >= skip - 1]
    sampling = [scored[e] - last_step[e - 1] for e in sorted(scored) if e - 1 in last_step and e >= skip]
    return {"time/rollout_s": statistics.fmean(sampling) if sampling else float("nan"),
            "time/train_s": statistics.fmean(update) if update else float("nan")}


def prompt_dir(work: Path, args) -> Path:
    """The folder of ``train.txt`` / ``test.txt`` both trainers read: the 8 short prompts, or flow_grpo's own
    pickscore files from the checkout."""
    return args.flow_grpo / "dataset" / "pickscore" if args.prompts == "pickscore" else work / "prompts"


def busy_processes(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes (a pure-Python spin each): the competing load."""
    return [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(n)]


def stop(busy: list[subprocess.Popen]) -> None:
    for p in busy:
        p.kill()
        p.wait()


def timed(run, work: Path, index: int, args, load: int) -> dict:
    """One run beside ``load`` busy processes (none: quiet), with its mean step and images/s."""
    busy = busy_processes(load)
    try:  # each run its own output folder: a second run into a finished one would resume it and train nothing
        record = run(work, f"{index}-load{load}" if load else str(index), args)
    finally:
        stop(busy)
    record["pair"], record["load_processes"] = index, load
    record["mean_step_s"] = statistics.fmean(record["step_s"])
    record["images_per_s"] = IMAGES_PER_STEP / record["mean_step_s"]
    phases = record["phases_s"]
    print(f"pair {index} {record['trainer']:9s} {'quiet' if not load else f'load {load}':7s} "
          f"{record['mean_step_s']:.2f} s/step ({record['images_per_s']:.2f} images/s; sampling "
          f"{phases['time/rollout_s']:.2f} s, update {phases['time/train_s']:.2f} s), load avg "
          f"{record['load_avg_1m_at_start']:.1f}", flush=True)
    return record


def alternate(work: Path, args, result: dict) -> None:
    """Pairs of runs, alternating which trainer starts; each beside ``--load`` busy processes, and with
    ``--paired-quiet`` each trainer's loaded run beside a quiet one of its own, quiet first in even pairs and last
    in odd ones (the degradation, loaded over quiet, from runs minutes apart rather than from two invocations)."""
    for i in range(args.pairs):
        order = (run_omnirl, run_flow_grpo) if i % 2 == 0 else (run_flow_grpo, run_omnirl)
        pair: dict = {"pair": i}
        loaded: dict = {}
        for run in order:
            # with --paired-quiet the quiet run comes first in even pairs and last in odd ones: a trainer's second
            # run of a pair can be faster than its first whatever the load (flow_grpo's was, in every pair that
            # ran quiet first), and alternating keeps that order effect out of the mean degradation
            quiet_first = i % 2 == 0
            if args.paired_quiet and quiet_first:
                quiet = timed(run, work, i, args, 0)
                result["runs"].append(quiet)
            record = timed(run, work, i, args, args.load)
            result["runs"].append(record)
            if args.paired_quiet and not quiet_first:
                quiet = timed(run, work, i, args, 0)
                result["runs"].append(quiet)
            loaded[record["trainer"]] = record
            if args.paired_quiet:
                pair[f"{record['trainer']}_loaded_over_quiet"] = record["mean_step_s"] / quiet["mean_step_s"]
        pair["omnirl_over_flow_grpo"] = loaded["omnirl"]["images_per_s"] / loaded["flow_grpo"]["images_per_s"]
        pair["update_time_ratio"] = (loaded["omnirl"]["phases_s"]["time/train_s"]
                                     / loaded["flow_grpo"]["phases_s"]["time/train_s"])
        result["pairs"].append(pair)
        print(f"pair {i}: omnirl {pair['omnirl_over_flow_grpo']:.2f}x flow_grpo's images/s; omnirl's update takes "
              f"{pair['update_time_ratio']:.2f}x flow_grpo's", flush=True)
        if args.paired_quiet:
            print(f"pair {i}: loaded over quiet: omnirl {pair['omnirl_loaded_over_quiet']:.2f}x, flow_grpo "
                  f"{pair['flow_grpo_loaded_over_quiet']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow-grpo", type=Path, required=True, help="a checkout of github.com/yifan123/flow_grpo")
    parser.add_argument("--python", type=Path, required=True, help="the Python of an environment that runs it")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=17, help="steps (epochs) per run")
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out of the timing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    parser.add_argument("--omnirl-threads", default=None, help="omnirl's run.threads (default: --threads; "
                        "'adaptive' is its default policy, which gives up a thread while the CPUs are shared)")
    parser.add_argument("--cfg-grad", choices=("both", "cond"), default="cond",
                        help="omnirl's train.cfg_grad: cond (default; flow_grpo's gradient) detaches the unconditional "
                        "branch as train_sd3.py does; both differentiates both branches, more work than flow_grpo does")
    parser.add_argument("--omnirl-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for omnirl's runs only, e.g. GOMP_SPINCOUNT=300000 (repeatable)")
    parser.add_argument("--omnirl-micro", default="auto", help="omnirl's train.micro_batch_size (default auto)")
    parser.add_argument("--prompts", choices=("short", "pickscore"), default="short",
                        help="8 short prompts, or flow_grpo's dataset/pickscore prompt files")
    parser.add_argument("--load", type=int, default=0, help="busy processes (a pure-Python spin each) beside every "
                        "run: the shared-CPU case")
    parser.add_argument("--paired-quiet", action="store_true", help="with --load: each trainer's loaded run beside "
                        "a quiet one of its own (quiet first in even pairs, last in odd ones), and each pair reports "
                        "both trainers' degradation (loaded over quiet)")
    args = parser.parse_args()
    if args.paired_quiet and not args.load:
        raise SystemExit("--paired-quiet compares runs beside --load N busy processes with quiet ones: pass --load")
    if args.omnirl_threads is not None and args.omnirl_threads.isdigit():
        args.omnirl_threads = int(args.omnirl_threads)
    if not (args.flow_grpo / "scripts" / "train_sd3.py").is_file():
        raise SystemExit(f"{args.flow_grpo} has no scripts/train_sd3.py: pass a checkout of flow_grpo")
    if args.prompts == "pickscore" and not (args.flow_grpo / "dataset" / "pickscore" / "train.txt").is_file():
        raise SystemExit(f"{args.flow_grpo}/dataset/pickscore/train.txt is missing: a full checkout has it")
    if args.omnirl_micro.isdigit():
        args.omnirl_micro = int(args.omnirl_micro)
    work = Path(tempfile.mkdtemp(prefix="omnirl-reference-"))
    from omnirl_plugin_sd35.tiny import save_tiny

    save_tiny(work / "sd35-tiny")
    (work / "prompts").mkdir()
    (work / "prompts" / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (work / "prompts" / "test.txt").write_text("\n".join(PROMPTS[:4]) + "\n")
    (work / "flow_grpo_config.py").write_text(FLOW_GRPO_CONFIG)
    (work / "driver.py").write_text(DRIVER)
    (work / "omnirl.yaml").write_text(yaml.safe_dump(omnirl_recipe(work / "sd35-tiny", prompt_dir(work, args), args.steps,
                                                                   args.omnirl_threads or args.threads,
                                                                   args.cfg_grad, args.omnirl_micro), sort_keys=False))
    from _train import describe, environment, write

    result = {"environment": environment(), "work": textwrap.dedent(__doc__.split("The work, ")[1].split("Each run")[0]),
              "images_per_step": IMAGES_PER_STEP, "steps": args.steps, "timed_steps": f"{args.skip + 1}-{args.steps}",
              "threads": args.threads, "omnirl_threads": args.omnirl_threads or args.threads, "omnirl_cfg_grad": args.cfg_grad, "omnirl_micro_batch_size": args.omnirl_micro,
              "omnirl_env": args.omnirl_env, "prompts": args.prompts,
              "load_processes": args.load, "runs": [], "pairs": []}
    print("machine:", describe(result["environment"]), flush=True)
    alternate(work, args, result)
    ratios = [p["omnirl_over_flow_grpo"] for p in result["pairs"]]
    for trainer in ("omnirl", "flow_grpo"):
        runs = [r for r in result["runs"] if r["trainer"] == trainer and r["load_processes"] == args.load]
        result[trainer] = {"images_per_s": statistics.fmean(r["images_per_s"] for r in runs),
                           "mean_step_s": statistics.fmean(r["mean_step_s"] for r in runs)}
    result["omnirl_over_flow_grpo"] = {"mean_images_per_s_ratio": result["omnirl"]["images_per_s"]
                                       / result["flow_grpo"]["images_per_s"],
                                       "per_pair": ratios, "median": statistics.median(ratios),
                                       "update_time_median": statistics.median(p["update_time_ratio"]
                                                                               for p in result["pairs"])}
    if args.paired_quiet:
        result["loaded_over_quiet_median"] = {t: statistics.median(p[f"{t}_loaded_over_quiet"] for p in result["pairs"])
                                              for t in ("omnirl", "flow_grpo")}
    path = write("reference_trainer" + (f"-load{args.load}" if args.load else "")
                 + ("-paired" if args.paired_quiet else ""), result)
    print(f"omnirl {result['omnirl']['images_per_s']:.2f} images/s, flow_grpo {result['flow_grpo']['images_per_s']:.2f}: "
          f"{result['omnirl_over_flow_grpo']['mean_images_per_s_ratio']:.2f}x (pairs "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); update time {result['omnirl_over_flow_grpo']['update_time_median']:.2f}x "
          f"(median); on {describe(result['environment'])}; wrote {path}")


if __name__ == "__main__":
    main()
