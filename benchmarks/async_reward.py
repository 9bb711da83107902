"""Async streaming reward vs sync reward, side by side in one run (alternating steps).

    python benchmarks/async_reward.py [--steps 2] [--quick]

(a) ``ocr``: the real OCR reward (RapidOCR on CPU) on the same 2 cores as the rollout.
(b) ``vlm-judge``: a stand-in judge with the OpenAI-compatible chat-completions API, served on this machine
    in another process, with a set latency per image (it scores mean brightness, deterministically). It
    STANDS FOR A VLM JUDGE ON OTHER HARDWARE: its cost to the trainer is latency, not our CPU.
    The latency is set from a measured rollout so that the reward phase is about 0.8 x the rollout.
(c) ``learned``: a learned reward (``--learned pickscore``, its tiny preset unless ``--learned-set`` gives
    other options) on its own worker: ``omnirl reward serve`` in another process (1 torch thread), reached
    through the ``remote`` reward. On this 2-core machine its compute shares the cores with the rollout.

Per mode: step time; rollout R and reward W (sync: the scoring wall time after the rollout); the ideal
bound of the rollout+reward phase, max(R, W), vs the sum R + W; and the fraction of the ideal saving
min(R, W) that async achieves: ((R + W)_sync - phase_async) / min(R, W)_sync, with phase = rollout time +
the reward time left after it. Writes ``benchmarks/results/async_reward.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _train import controller, environment, mean, write

from omnirl_core.config import deep_merge, parse_set

PROMPTS = ['a shop sign that says "OPEN"', 'a poster with the word "OMNI"', 'a neon sign reading "FLOW"',
           'a street sign that says "STOP"', 'a book cover titled "RL"', 'a banner that says "HELLO"',
           'a label that says "TEA"', 'a door sign that says "EXIT"']


def workload(args, reward: list[dict], workers: int) -> dict:
    run = {"reward_workers": workers, "reward_concurrency": args.concurrency, "seed": 3,
           "reward_batching": args.batching}
    if args.executor == "ray":  # a colocated actor+rollout worker on both cores, reward actors beside it
        run.update({"executor": "ray", "worker_cpus": 2.0})
    return deep_merge({
        "rewards": reward, "data": {"prompts": PROMPTS},
        "rollout": {"prompts_per_step": args.prompts, "group_size": 4, "num_steps": args.num_steps,
                    "height": args.size, "width": args.size,
                    # step-wise batching with 4 slots: samples finish in waves and stream out
                    "options": {"max_num_seqs": 4}},
        "train": {"minibatches": 1},
        "run": run,
    }, parse_set(args.sets))


def alternate(ctl, steps: int) -> dict:
    """Warm up one step, then alternate sync / async steps; returns per-mode records."""
    def set_mode(mode: str) -> None:
        ctl.cfg.run.reward_mode = mode  # what the Ray executor reads at each rollout
        if getattr(ctl.executor, "stream", None) is not None:  # the inline executor's reward threads
            ctl.executor.stream.mode = mode

    ctl.setup()
    set_mode("sync")
    ctl.train_step(1)
    records = {"sync": [], "async": []}
    for i in range(2 * steps):
        mode = ("sync", "async")[i % 2]
        set_mode(mode)
        records[mode].append(ctl.train_step(2 + i))
    ctl.executor.close()
    return records


def summary(records: dict) -> dict:
    out = {}
    for mode, recs in records.items():
        r, w = mean(recs, "time/rollout_s"), mean(recs, "time/reward_s")
        out[mode] = {"step_s": mean(recs, "time/step_s"), "rollout_s": r, "reward_wait_s": w,
                     "reward_busy_s": mean(recs, "time/reward_busy_s"), "train_s": mean(recs, "time/train_s"),
                     "rollout_plus_reward_s": r + w, "steps": len(recs),
                     "reward_calls": mean(recs, "time/reward_calls"),  # Ray: calls per step (inline: absent, 0)
                     "threads": [rec.get("threads/torch") for rec in recs]}  # the rollout's pool (run.threads)
    s, a = out["sync"], out["async"]
    r, w = s["rollout_s"], s["reward_wait_s"]
    ideal_saving = min(r, w)
    achieved = s["rollout_plus_reward_s"] - a["rollout_plus_reward_s"]
    out["bound"] = {"sum_s": r + w, "ideal_max_s": max(r, w), "ideal_saving_s": ideal_saving,
                    "achieved_saving_s": achieved,
                    "fraction_of_ideal_saving": achieved / ideal_saving if ideal_saving > 0 else float("nan"),
                    "step_speedup": s["step_s"] / a["step_s"]}
    # each back-to-back (sync, async) pair on its own: the spread the machine's noise gives the fraction
    pairs = []
    for rs, ra in zip(records["sync"], records["async"]):
        r, w = rs["time/rollout_s"], rs["time/reward_s"]
        pairs.append((r + w - ra["time/rollout_s"] - ra["time/reward_s"]) / min(r, w) if min(r, w) > 0 else float("nan"))
    out["bound"]["fraction_pairs"] = pairs
    out["bound"]["fraction_pairs_median"] = statistics.median(pairs) if pairs else float("nan")
    return out


def start_judge(latency: float) -> tuple[subprocess.Popen, str]:
    from omnirl_core.loop.distributed import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "omnirl_plugin_vlm_judge.server", "--port", str(port),
                             "--latency-ms", f"{1000 * latency:.1f}"], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # the server prints its address once it listens
    return proc, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per mode after one warm-up step")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x 4 samples)")
    parser.add_argument("--workers", type=int, default=4, help="reward threads for the judge (concurrent requests)")
    parser.add_argument("--ocr-workers", type=int, default=1, help="reward threads for OCR (CPU-bound: they take "
                        "cores from the rollout)")
    parser.add_argument("--size", type=int, default=64, help="image height and width (pixels)")
    parser.add_argument("--num-steps", type=int, default=10, help="sampling steps per image")
    parser.add_argument("--quick", action="store_true", help="1 step per mode, 4 prompts, 32 px, 6 steps")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="calls each reward worker serves at once (run.reward_concurrency)")
    parser.add_argument("--judge-concurrency", type=int, default=None,
                        help="the judge's requests in flight per reward instance (default: reward_concurrency on "
                        "Ray, workers x reward_concurrency inline); the latency is set from the total")
    parser.add_argument("--executor", choices=("inline", "ray"), default="inline",
                        help="ray: a local Ray instance, reward actors instead of threads")
    parser.add_argument("--only", choices=("vlm_judge", "ocr", "learned"), default=None, help="run one scenario")
    parser.add_argument("--learned", default="pickscore", help="the learned reward served for scenario (c)")
    parser.add_argument("--learned-set", action="append", default=None,
                        help="its options (repeatable; default: preset=tiny, device=cpu)")
    parser.add_argument("--learned-workers", type=int, default=2, help="reward threads (concurrent requests) "
                        "for the served reward")
    parser.add_argument("--learned-clip", default=None, metavar="WIDTHxLAYERS@SIZE",
                        help="serve a random-weight CLIP of this size (e.g. 256x6@224) through the reward's real "
                        "loading path instead of its tiny preset, so that scoring costs about what a rollout does")
    parser.add_argument("--learned-rollout-threads", type=int, default=None,
                        help="run.rollout_threads for scenario (c): the cores the rollout leaves to the server "
                        "on the same machine")
    parser.add_argument("--learned-nice", type=int, default=0, help="start the reward server at this nice level")
    parser.add_argument("--learned-served", action="store_true",
                        help="with --executor ray: serve the learned reward (`omnirl reward serve`) and reach it "
                        "through the remote reward from the reward actors, as inline does, instead of running it "
                        "in the actors")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for every scenario (repeatable), e.g. run.ray_worker_niceness=null")
    parser.add_argument("--batching", action="store_true", help="run.reward_batching: a freed reward worker scores "
                        "what finished meanwhile in one call")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts, args.size, args.num_steps = 1, 4, 32, 6
    tmp = Path(tempfile.mkdtemp(prefix="omnirl-bench-"))
    if args.executor == "ray":
        import ray

        # logical CPUs: 2 for the rollout/actor worker, 0.5 per reward actor (they mostly wait)
        ray.init(num_cpus=2 + max(args.workers, args.ocr_workers), include_dashboard=False, log_to_driver=False)
    result = {"environment": environment(), "executor": args.executor, "samples_per_step": args.prompts * 4, "size": args.size,
              "num_steps": args.num_steps}

    workers = args.workers
    if args.only in (None, "vlm_judge"):
        run_judge(args, tmp, workers, result)
    if args.only in (None, "ocr"):
        run_ocr(args, tmp, args.ocr_workers, result)
    if args.only in (None, "learned"):
        run_learned(args, tmp, result)
    if args.executor == "ray":
        ray.shutdown()
    path = write("async_reward" if args.executor == "inline" else "async_reward_ray", result)
    for name in ("vlm_judge", "ocr", "learned"):
        part = result.get(name)
        if part is None:
            continue
        print(f"{name}: step sync {part['sync']['step_s']:.2f}s async {part['async']['step_s']:.2f}s | "
              f"R {part['sync']['rollout_s']:.2f}s W {part['sync']['reward_wait_s']:.2f}s | "
              f"sum {part['bound']['sum_s']:.2f}s ideal {part['bound']['ideal_max_s']:.2f}s async "
              f"{part['async']['rollout_plus_reward_s']:.2f}s | fraction of ideal saving "
              f"{part['bound']['fraction_of_ideal_saving']:.2f} (pairs "
              f"{', '.join(f'{x:.2f}' for x in part['bound']['fraction_pairs'])}; median "
              f"{part['bound']['fraction_pairs_median']:.2f})")
    print(f"wrote {path}")


def run_judge(args, tmp: Path, workers: int, result: dict) -> None:
    # the rollout time measured by warm-up steps sets the judge's latency
    probe = controller(tmp / "probe", workload(args, [{"name": "jpeg"}], workers))
    probe.setup()
    probe.train_step(1)
    rollout_s = probe.train_step(2)["time/rollout_s"]
    probe.executor.close()
    # the judge's own `concurrency` bounds the requests in flight of one reward instance (all the inline reward
    # threads share one; each Ray reward actor has its own). By default workers x reward_concurrency requests are
    # in flight; --judge-concurrency sets the instance's bound instead (on Ray: each actor's)
    if args.judge_concurrency is not None:
        in_flight = args.judge_concurrency
        total = in_flight * (workers if args.executor == "ray" else 1)
    else:
        in_flight = args.concurrency if args.executor == "ray" else workers * args.concurrency
        total = workers * args.concurrency
    latency = 0.8 * rollout_s * total / (args.prompts * 4)  # the judge's capacity scores a step in 0.8 R
    judge, url = start_judge(latency)
    try:
        t0 = time.perf_counter()
        reward = {"name": "vlm-judge", "options": {"url": url, "model": "stand-in", "concurrency": in_flight}}
        ctl = controller(tmp / "judge", workload(args, [reward], workers))
        result["vlm_judge"] = {
            "note": "The judge is a stand-in served over HTTP on this machine in another process, with a set "
                    "latency per image: it stands for a VLM judge on other hardware (its cost is latency).",
            "latency_per_image_s": latency, "reward_workers": workers, "judge_concurrency": in_flight,
            "requests_in_flight_max": total, **summary(alternate(ctl, args.steps)),
            "wall_s": time.perf_counter() - t0,
        }
    finally:
        judge.terminate()
        judge.wait()


def run_ocr(args, tmp: Path, workers: int, result: dict) -> None:
    t0 = time.perf_counter()
    ctl = controller(tmp / "ocr", workload(args, [{"name": "ocr"}], workers))
    result["ocr"] = {
        "note": "Real OCR (RapidOCR, onnxruntime, 1 thread per call) on the same 2 CPU cores as the rollout: "
                "the overlap can only use what the rollout leaves idle.",
        "reward_workers": workers, **summary(alternate(ctl, args.steps)), "wall_s": time.perf_counter() - t0,
    }


def random_clip(directory: Path, spec: str) -> Path:
    """A random-weight CLIPModel + processor of ``WIDTHxLAYERS@SIZE`` (patch 16, heads width / 64) saved with
    ``save_pretrained``: loaded by the reward through the same path as a released checkpoint."""
    import torch
    from transformers import CLIPModel

    from omnirl_core.rewards_kit.tiny_clip import clip_bpe_tokenizer, tiny_clip_config, tiny_processor

    shape, size = spec.split("@")
    width, layers = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    tokenizer = clip_bpe_tokenizer()
    config = tiny_clip_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id, "gelu",
                              image_size=int(size), patch_size=16, width=width, layers=layers,
                              heads=max(1, width // 64), projection_dim=width)
    CLIPModel(config).save_pretrained(str(directory))
    tiny_processor(tokenizer, int(size)).save_pretrained(str(directory))
    return directory


def run_learned(args, tmp: Path, result: dict) -> None:
    options = args.learned_set or ["preset=tiny", "device=cpu"]
    if args.learned_clip:
        directory = random_clip(tmp / "clip", args.learned_clip)
        options = [f"path={directory}", f"processor_path={directory}", "device=cpu"]
    if args.executor == "ray" and not args.learned_served:  # the reward itself in each reward actor, no server
        reward = {"name": args.learned, "options": dict(o.split("=", 1) for o in options)}
        run_learned_with(args, tmp, result, reward, options,
                         f"{args.learned} ({', '.join(options)}) in {args.learned_workers} Ray reward actor(s) "
                         "of their own (1 torch thread each): a learned reward on its own worker.")
        return
    import os

    from omnirl_core.loop.distributed import free_port

    port = free_port()
    exe = Path(sys.executable).with_name("omnirl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch in the server: one intra-op thread
    nice = ["nice", "-n", str(args.learned_nice)] if args.learned_nice else []
    server = subprocess.Popen([*nice, str(exe), "reward", "serve", args.learned, "--port", str(port),
                               *[x for o in options for x in ("--set", o)]], stderr=subprocess.PIPE, text=True,
                              env=env)
    try:
        while "serving reward" not in (line := server.stderr.readline()):
            if not line and server.poll() is not None:
                raise RuntimeError(f"the reward server for {args.learned} did not start")
        reward = {"name": "remote", "options": {"url": f"http://127.0.0.1:{port}", "expect": args.learned}}
        run_learned_with(args, tmp, result, reward, options,
                         f"{args.learned} ({', '.join(options)}) served by `omnirl reward serve` in another process "
                         "(1 torch thread), reached through the remote reward: a learned reward on its own worker.")
    finally:
        server.terminate()
        server.wait()


def run_learned_with(args, tmp: Path, result: dict, reward: dict, options: list[str], note: str) -> None:
    t0 = time.perf_counter()
    config = workload(args, [reward], args.learned_workers)
    if args.learned_rollout_threads is not None:
        if args.executor == "ray":  # the rollout worker's CPUs size its torch pool
            config["run"]["worker_cpus"] = float(args.learned_rollout_threads)
        else:
            config["run"]["rollout_threads"] = args.learned_rollout_threads
    plugins = (f"omnirl_plugin_{args.learned.replace('-', '_')}",) if reward["name"] != "remote" else ()
    ctl = controller(tmp / "learned", config, plugins)
    result["learned"] = {
        "note": note, "reward": args.learned, "options": options, "reward_workers": args.learned_workers,
        "clip": args.learned_clip, "rollout_threads": args.learned_rollout_threads,
        **summary(alternate(ctl, args.steps)), "wall_s": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    main()
