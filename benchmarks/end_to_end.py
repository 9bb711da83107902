"""End-to-end step time: omnirl's training step against the model-call floor, quiet and under a competing CPU
load, per thread policy.

    python benchmarks/end_to_end.py                         # tiny preset: the default policy, a fixed pool, libgomp's own
    python benchmarks/end_to_end.py --config small          # the rollout benchmark's 8-layer transformer
    python benchmarks/end_to_end.py --policies default,gomp,passive --reps 3

For each policy (a child process, since the OpenMP runtime reads its wait policy when torch loads):
- ``step``: omnirl's FlowGRPO step (rollout with rewards, update, sync) from its metrics, per phase;
- ``floor``: the same model calls made back to back in a bare loop in the same process: the rollout's
  transformer calls (CFG as configured) over the whole batch and the VAE decode, the no-grad passes of the
  update (old log-probs, the reference for the KL term) and forward+backward at the same micro-batch sizes
  with one AdamW step per minibatch. ``step / floor`` is the framework's overhead;
- both again while ``--load-threads`` busy processes (default: one per core) compete for the CPUs:
  ``loaded / quiet`` is the degradation, for omnirl's step and for the bare loop; ``settled``: the same
  without each round's first step (the step the load started or stopped under: the default policy re-judges
  its pool at each step; it gives up a thread at once when other processes fill every core, and takes one back
  at once when no other process has a runnable task).
Quiet and loaded measurements alternate within each child (``--reps`` rounds), so a drift of the machine's
own load hits both. Writes ``benchmarks/results/end_to_end[-CONFIG].json``.

Policies: ``default`` (omnirl's, ``omnirl_core.host.threads``: ``run.threads: adaptive``, a thread fewer
while the process waits for CPUs, and a brief spin), ``fixed`` (``run.threads: fixed``: every core, always),
and with a fixed pool too: ``gomp`` (libgomp's own spin count, 300000), ``passive`` (OMP_WAIT_POLICY=PASSIVE),
``spin=N`` (GOMP_SPINCOUNT=N). The floor always runs with the full pool: it is the bare loop a user would write.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
POLICY_ENV = {"default": {}, "fixed": {}, "gomp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def policy_env(name: str) -> dict[str, str]:
    if name.startswith("spin="):
        return {"GOMP_SPINCOUNT": name.split("=", 1)[1]}
    return POLICY_ENV[name]


# -- the competing load --------------------------------------------------------------------------------

class Load:
    """``threads`` busy processes (a pure-Python spin each), started and stopped around a measurement."""

    def __init__(self, threads: int):
        self.threads = threads
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Load:  # noqa: PYI034 - a plain class, never subclassed
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass"]) for _ in range(self.threads)]
        time.sleep(0.5)  # the scheduler has seen them
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


# -- the child: one policy -----------------------------------------------------------------------------

def build(config: str, out: Path, steps: int, run_threads: str = "adaptive") -> Any:
    sys.path.insert(0, str(HERE))
    from _train import controller

    overrides: dict[str, Any] = {"run": {"steps": 10_000, "threads": run_threads}}
    if config == "small":
        from rollout_batching import build_model  # the rollout benchmark's 8-layer x 128 transformer

        model_dir = out / "small-model"
        if not model_dir.is_dir():
            build_model("small").pipeline.save_pretrained(model_dir)
        overrides["model"] = {"path": str(model_dir), "preset": None}
        overrides["rollout"] = {"height": 64, "width": 64, "num_steps": 10, "guidance_scale": 4.5,
                                "prompts_per_step": 4, "group_size": 4}
        overrides["train"] = {"lr": 1e-3, "minibatches": 2, "micro_batch_size": 8}
        overrides["algorithm"] = {"name": "flowgrpo", "options": {"beta": 0.04}}
    ctl = controller(out / "run", overrides)
    ctl.setup()
    return ctl


def floor(ctl: Any, step: int, pool: int) -> dict[str, float]:
    """The model calls of one step, back to back (see the module docstring), on ``pool`` torch threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(pool)
    try:
        return _floor(ctl, step)
    finally:
        torch.set_num_threads(before)


def _floor(ctl: Any, step: int) -> dict[str, float]:
    import torch

    from omnirl_core.loop.training import chunks

    cfg, worker = ctl.cfg, ctl.executor.worker
    model = worker.model
    requests = ctl.requests(step)
    n = len(requests)
    guidance = cfg.rollout.guidance_scale
    with torch.no_grad():
        cond = model.encode([r.prompt for r in requests])  # the engine's embedding cache serves these
        uncond = model.encode([cfg.rollout.negative_prompt] * n) if guidance > 1 else None
    shape = model.latent_shape(cfg.rollout.height, cfg.rollout.width, cfg.rollout.num_frames)
    sigmas = model.sigmas(cfg.rollout.num_steps, shape)
    plan = ctl.algorithm.plan(step)
    gen = torch.Generator().manual_seed(step)
    t0 = time.perf_counter()
    with torch.no_grad():
        x = torch.randn((n, *shape), generator=gen)
        for i in range(len(sigmas) - 1):
            v = model.velocity(x, sigmas[i].expand(n), cond, guidance, uncond)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        model.decode(x)
    t1 = time.perf_counter()
    units = n * len(plan.train_steps)
    xs = torch.randn((units, *shape), generator=gen)
    sig = sigmas[torch.randint(0, len(sigmas) - 1, (units,), generator=gen)]
    index = [i % n for i in range(units)]
    mbs = cfg.train.micro_batch_size
    passes = int(cfg.train.old_logprob == "recompute") + int(getattr(ctl.algorithm, "uses_reference", False))
    params = model.trainable_parameters()
    saved = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr)
    with torch.no_grad():
        for p in range(passes):
            context = model.reference() if p == 1 or cfg.train.old_logprob != "recompute" else _nullcontext()
            with context:
                for idx in chunks(list(range(units)), mbs):
                    model.velocity(xs[idx], sig[idx], cond.select([index[i] for i in idx]), guidance,
                                   uncond.select([index[i] for i in idx]) if uncond is not None else None)
    size = -(-units // cfg.train.minibatches)
    for start in range(0, units, size):
        optimizer.zero_grad(set_to_none=True)
        for idx in chunks(list(range(start, min(start + size, units))), mbs):
            v = model.velocity(xs[idx], sig[idx], cond.select([index[i] for i in idx]), guidance,
                               uncond.select([index[i] for i in idx]) if uncond is not None else None)
            v.float().square().mean().backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        optimizer.step()
    t2 = time.perf_counter()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)  # the floor leaves the run's weights as they were
    return {"floor_s": t2 - t0, "floor_rollout_s": t1 - t0, "floor_train_s": t2 - t1}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


PHASES = ("time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s")


def child(args: argparse.Namespace) -> dict[str, Any]:
    from omnirl_core.host import threads

    threads.apply_env()  # as the CLI does, before torch loads; a policy's variables were set by the parent
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        ctl = build(args.config, Path(tmp), args.reps, args.run_threads)
        policy = threads.configure(args.run_threads).as_dict()
        pool = policy["intra_op"]
        step = 1
        rows: dict[str, list[dict[str, float]]] = {"quiet": [], "loaded": []}
        floors: dict[str, list[float]] = {"quiet": [], "loaded": []}
        floor_phases: dict[str, list[dict[str, float]]] = {"quiet": [], "loaded": []}
        for _ in range(args.warmup):
            ctl.train_step(step)
            floor(ctl, step, pool)
            step += 1
        for _ in range(args.reps):
            for mode in ("quiet", "loaded"):
                load = Load(args.load_threads) if mode == "loaded" else _nullcontext()
                with load:
                    for _ in range(args.steps):
                        record = ctl.train_step(step)
                        rows[mode].append({k: record[k] for k in ("time/step_s", "threads/torch", *PHASES)
                                           if k in record})
                        bare = floor(ctl, step, pool)
                        floors[mode].append(bare["floor_s"])
                        floor_phases[mode].append(bare)
                        step += 1
        ctl.executor.close()
        ctl.run_dir.unlock()
    out: dict[str, Any] = {"threads": policy, "torch_threads": torch.get_num_threads()}
    for mode in ("quiet", "loaded"):
        step_s = statistics.median(r["time/step_s"] for r in rows[mode])
        phases = {k.split("/")[1]: statistics.median(r.get(k, 0.0) for r in rows[mode]) for k in PHASES}
        phases["other_s"] = step_s - sum(phases.values())
        out[mode] = {"step_s": step_s, "floor_s": statistics.median(floors[mode]), "phases": phases,
                     "steps": [r["time/step_s"] for r in rows[mode]], "floors": floors[mode],
                     "update_threads": [r.get("threads/torch") for r in rows[mode]],
                     # the floor's own split: its rollout (transformer calls and decode) against the step's
                     # rollout phase, its update against the step's train phase
                     "floor_phases": {k.split("_", 1)[1]: statistics.median(f[k] for f in floor_phases[mode])
                                      for k in ("floor_rollout_s", "floor_train_s")}}
        out[mode]["overhead"] = step_s / out[mode]["floor_s"]
    out["degradation"] = out["loaded"]["step_s"] / out["quiet"]["step_s"]
    out["bare_degradation"] = out["loaded"]["floor_s"] / out["quiet"]["floor_s"]
    if args.steps > 1:  # once settled: without each round's first step, the one the load changed under
        for mode in ("quiet", "loaded"):
            settled = [s for i, s in enumerate(out[mode]["steps"]) if i % args.steps]
            out[mode]["settled_step_s"] = statistics.median(settled)
        out["settled_degradation"] = out["loaded"]["settled_step_s"] / out["quiet"]["settled_step_s"]
    return out


# -- the parent: every policy --------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--policies", default="default,fixed,gomp", help="comma-separated (see the module docstring)")
    parser.add_argument("--reps", type=int, default=2, help="quiet/loaded rounds per policy")
    parser.add_argument("--steps", type=int, default=2, help="steps per round and mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--load-threads", type=int, default=None, help="busy processes (default: one per core)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-threads", default="adaptive", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_threads is None:
        from omnirl_core.host.threads import available_cpus

        args.load_threads = available_cpus()
    if args.child:
        print(json.dumps(child(args)))
        return
    result: dict[str, Any] = {"config": args.config, "reps": args.reps, "steps": args.steps,
                              "load_threads": args.load_threads, "load_avg_1m_before": os.getloadavg()[0],
                              "policies": {}}
    for name in args.policies.split(","):
        env = {**os.environ, **policy_env(name)}
        cmd = [sys.executable, __file__, "--child", "--config", args.config, "--reps", str(args.reps),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--load-threads", str(args.load_threads)]
        if name != "default":
            cmd += ["--run-threads", "fixed"]  # the wait policies are compared on a fixed pool
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"policy {name} failed:\n{proc.stderr[-3000:]}")
        key = name if name not in result["policies"] else f"{name}#{sum(k.split('#')[0] == name for k in result['policies']) + 1}"
        result["policies"][key] = json.loads(proc.stdout.strip().splitlines()[-1])  # a repeat: default#2, ...
        r = result["policies"][key]
        print(f"{key:>10}: quiet step {r['quiet']['step_s']:.3f} s (floor {r['quiet']['floor_s']:.3f} s, overhead "
              f"{r['quiet']['overhead']:.2f}x) | loaded step {r['loaded']['step_s']:.3f} s (floor "
              f"{r['loaded']['floor_s']:.3f} s) | degradation {r['degradation']:.2f}x"
              + (f" (settled {r['settled_degradation']:.2f}x)" if "settled_degradation" in r else "")
              + f", bare loop {r['bare_degradation']:.2f}x", flush=True)
        q = r["quiet"]
        print(f"{'':>10}  quiet: rollout {q['phases']['rollout_s']:.3f} s (floor {q['floor_phases']['rollout_s']:.3f} s), "
              f"train {q['phases']['train_s']:.3f} s (floor {q['floor_phases']['train_s']:.3f} s), reward "
              f"{q['phases']['reward_s']:.3f} s, other {q['phases']['other_s']:.3f} s", flush=True)
    result["load_avg_1m_after"] = os.getloadavg()[0]
    sys.path.insert(0, str(HERE))
    from _train import environment, write

    result["environment"] = environment()
    path = write("end_to_end" + ("" if args.config == "tiny" else f"-{args.config}"), result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
