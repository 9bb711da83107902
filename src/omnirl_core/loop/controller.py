"""The single controller: prompts -> rollout -> reward -> advantage -> update -> (sync) -> metrics.

Plain Python; the executor owns every tensor. Prompts and seeds depend only on (run seed, step), so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omnirl_core.contracts import GenRequest, Sample
from omnirl_core.data.sources import PromptData, PromptSampler, open_run_data
from omnirl_core.loop.cluster import WorkerLostError
from omnirl_core.loop.executors import make_executor
from omnirl_core.loop.interrupts import StopSignals
from omnirl_core.loop.trackers import TrackerRun, TrackerSet, resolve_trackers, step_audio, step_event
from omnirl_core.loop.worker import build_algorithm
from omnirl_core.resolve import ResolvedRun
from omnirl_core.rewards.dispatch import RewardHealth
from omnirl_core.rl.correction import FallbackMonitor
from omnirl_core.rundir.rundir import RunDir

log = logging.getLogger("omnirl")


def request_seed(run_seed: int, step: int, index: int) -> int:
    return ((run_seed * 1_000_003 + step) * 100_003 + index) % (2**62)


def summarise_rewards(samples: list[Sample], names: list[str]) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    out = {
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
    }
    for name in names:
        values = [s.rewards[name] for s in samples if name in s.rewards]
        out[f"reward/{name}"] = statistics.fmean(values) if values else float("nan")
    return out


class Controller:
    def __init__(self, resolved: ResolvedRun, run_dir: Path, on_step: Callable[[dict[str, Any]], None] | None = None,
                 data: PromptData | None = None):
        self.resolved = resolved
        self.cfg = resolved.config
        self.run_dir = RunDir(run_dir)
        self.on_step = on_step
        self.algorithm = build_algorithm(resolved)  # the controller's instance: plan, advantages, units
        self.old_logprob: str = self.cfg.train.old_logprob  # rollout correction's current mode (may fall back)
        self.executor = make_executor(resolved)
        self.data = data if data is not None else open_run_data(resolved)
        self.records = self.data.train
        self.prompts = PromptSampler([r["prompt"] for r in self.records], self.cfg.run.seed)
        self.start_step = 1
        self.current_step: int | None = None  # the step under way (None while setting up)
        self.fallback = FallbackMonitor(self.cfg.train.rs_fallback, self.cfg.train.rs_fallback_steps)
        self.reward_health = RewardHealth(self.cfg.run.reward_max_failed_steps)
        self.trackers = TrackerSet([])
        if self.cfg.run.trackers:
            from omnirl_core.plugins import get_plugin_manager

            self.trackers = TrackerSet(resolve_trackers(get_plugin_manager(), self.cfg))

    def requests(self, step: int) -> list[GenRequest]:
        cfg = self.cfg
        plan = self.algorithm.plan(step)
        out = []
        for b, (pidx, prompt) in enumerate(self.prompts.draw(step, cfg.rollout.prompts_per_step)):
            group_noise = request_seed(cfg.run.seed, step, 1_000_000 + b)
            for g in range(cfg.rollout.group_size):
                uid = b * cfg.rollout.group_size + g
                seed = request_seed(cfg.run.seed, step, uid)
                out.append(GenRequest(
                    uid=uid, prompt=prompt, prompt_index=pidx, group=b, seed=seed,
                    height=cfg.rollout.height, width=cfg.rollout.width, num_frames=cfg.rollout.num_frames,
                    guidance_scale=cfg.rollout.guidance_scale, plan=plan,
                    noise_seed=group_noise if plan.shared_initial_noise else seed,
                    inputs={k: v for k, v in self.records[pidx].items() if k != "prompt"},
                ))
        return out

    def setup(self) -> None:
        from omnirl_core.host.threads import configure
        from omnirl_core.rundir.checkpoint import (
            clean_partial,
            latest_checkpoint,
            load_checkpoint,
            metrics_copy,
        )

        self.run_dir.lock()  # no-op when the caller (the CLI's claim) holds it already
        clean_partial(self.run_dir.path)
        threads = {"threads": configure(self.cfg.run.threads).as_dict()}
        self.run_dir.save_runtime(threads)
        self.executor.setup()
        placed = self.executor.runtime()  # where the workers run (Ray: the node of each group's actors)
        if placed:
            self.run_dir.save_runtime({**threads, **placed})
        ckpt = latest_checkpoint(self.run_dir.path)
        if ckpt is None:
            self.run_dir.restore_metrics(b"")  # rows of an attempt that died before its first checkpoint
            return
        state = load_checkpoint(ckpt, self.executor.load_state)
        self.start_step = int(state["step"]) + 1
        correction = state.get("correction", {})
        self.fallback.load_state(correction)
        if correction.get("old_logprob", self.old_logprob) != self.old_logprob:
            self.set_old_logprob(correction["old_logprob"])
        self.reward_health.load_state(state.get("rewards", {}))
        self.run_dir.restore_metrics(metrics_copy(ckpt))
        log.info("resumed from %s (step %d)", ckpt, state["step"])

    def checkpoint(self, step: int) -> Path:
        from omnirl_core.rundir.checkpoint import save_checkpoint

        # the algorithm's own state is written by the actor worker, where it lives (algorithm.json)
        extra = {"correction": {"old_logprob": self.old_logprob, **self.fallback.state()},
                 "rewards": self.reward_health.state()}
        return save_checkpoint(self.run_dir.path, step, self.executor.save_state, extra,
                               self.run_dir.metrics_bytes())

    def set_old_logprob(self, mode: str) -> None:
        """Switch the rollout-correction mode for the following steps (every actor's algorithm reads it)."""
        self.old_logprob = mode
        self.executor.set_old_logprob(mode)

    def collect(self, step: int) -> tuple[list[Sample], dict[str, Any]]:
        """Rollout and rewards: in async mode each finished sample is scored while the rollout goes on."""
        t0 = time.perf_counter()
        samples, reward_metrics = self.executor.rollout(self.requests(step))
        samples.sort(key=lambda s: s.request.uid)  # the engine may finish them out of order
        reward_metrics.update(self.reward_health.settle(samples, self.cfg.rewards, step))
        reward_metrics["time/collect_s"] = time.perf_counter() - t0
        return samples, reward_metrics

    def learn(self, step: int, samples: list[Sample], reward_metrics: dict[str, Any]) -> dict[str, Any]:
        """Advantages, update, weight sync: the part of a step that changes the weights."""
        cfg = self.cfg
        t1 = time.perf_counter()
        adv_metrics = self.algorithm.assign_advantages(samples)
        units = self.algorithm.training_units(samples)
        train_metrics = self.executor.update(units, step)
        train_metrics["correction/recompute"] = float(self.old_logprob == "recompute")
        if self.fallback.observe(self.old_logprob, train_metrics):
            assert self.cfg.train.rs_fallback is not None  # observe answers True only with a threshold
            log.warning(
                "rollout correction: the RS mask rejected more than %.0f%% of the samples for %d steps in a row "
                "(last: %.1f%%); the rollout's log-probs no longer stand in for the old policy. Switching to "
                "train.old_logprob=recompute from step %d on.", 100 * self.cfg.train.rs_fallback,
                self.cfg.train.rs_fallback_steps, 100 * train_metrics["rs/rejected_frac"], step + 1)
            self.set_old_logprob("recompute")
            train_metrics["correction/fallback"] = 1.0
        t2 = time.perf_counter()
        sync_metrics = self.executor.sync_weights()
        t3 = time.perf_counter()
        record: dict[str, Any] = {"step": step}
        record.update(summarise_rewards(samples, [e.name for e in cfg.rewards]))
        record.update(reward_metrics)
        record.update(adv_metrics)
        record.update(train_metrics)
        record.update(sync_metrics)
        collect_s = record.pop("time/collect_s")
        record.update({
            "time/train_s": t2 - t1,
            "time/sync_s": t3 - t2,
            "time/step_s": collect_s + t3 - t1,
            "images_per_s": len(samples) / max(reward_metrics.get("time/rollout_s", collect_s), 1e-9),
        })
        if self.grid_due(step):
            self.run_dir.save_grid(step, [s.output for s in samples], [s.prompt for s in samples],
                                   columns=cfg.rollout.group_size, rewards=[s.reward for s in samples],
                                   sources=[s.condition_images for s in samples])
        return record

    def grid_due(self, step: int) -> bool:
        return step % self.cfg.run.sample_every == 0 or step == 1 or step == self.cfg.run.steps

    def eval_due(self, step: int) -> bool:
        every = self.cfg.run.eval_every
        return every is not None and (step % every == 0 or step == self.cfg.run.steps)

    def evaluate(self, step: int) -> dict[str, Any]:
        """The held-out evaluation after step ``step``'s update (``omnirl_core.loop.evaluation``): the first
        ``run.eval_prompts`` test prompts, ``run.eval_samples`` fixed seeds each, the ODE sampler; returns
        its ``eval/*`` metrics and writes ``eval/step-N/``."""
        from omnirl_core.loop.evaluation import eval_settings, evaluate, reward_displays, write_results

        cfg = self.cfg
        t0 = time.perf_counter()
        records = (self.data.test or [])[:cfg.run.eval_prompts]
        result = evaluate(lambda requests: self.executor.rollout(requests, evaluation=True)[0], records, cfg,
                          cfg.run.eval_samples, cfg.run.seed, label="trained", displays=reward_displays(self.resolved))
        settings = eval_settings(cfg, step=step, checkpoint=None, weights=None, during_training=True,
                                 prompts=self.data.source, test_prompts=len(records), samples=cfg.run.eval_samples,
                                 seed=cfg.run.seed)
        write_results(self.run_dir.path / "eval" / f"step-{step:06d}", [result], settings,
                      samples_per_prompt=cfg.run.eval_samples)
        return {**result.flat(), "time/eval_s": time.perf_counter() - t0}

    def _images(self, step: int) -> dict[str, Path]:
        """The PNGs this step saved, for trackers."""
        images = {}
        grid = self.run_dir.samples / f"step-{step:06d}.png"
        if self.grid_due(step) and grid.is_file():
            images["samples"] = grid
        evaluated = self.run_dir.path / "eval" / f"step-{step:06d}" / "trained.png"
        if self.eval_due(step) and evaluated.is_file():
            images["eval/samples"] = evaluated
        return images

    def train_step(self, step: int) -> dict[str, Any]:
        samples, reward_metrics = self.collect(step)
        return self.learn(step, samples, reward_metrics)

    def run(self) -> dict[str, Any]:
        """Steps from the last checkpoint to ``run.steps``. A step is in a checkpoint whole or not at all:
        a signal before the update stops at once and saves the last finished step; a signal during the
        update waits for the step to finish and be saved (see ``omnirl_core.loop.interrupts``)."""
        cfg = self.cfg
        signals = StopSignals()
        try:
            with signals.installed():
                self.setup()
                if self.trackers:
                    self.trackers.start(TrackerRun(self.run_dir.path, self.run_dir.path.name, self.resolved.dump(),
                                                   self.start_step))
                self._steps(signals)
        except WorkerLostError as err:  # a node (or a worker process) of the run is gone, with its state
            from omnirl_core.rundir.checkpoint import latest_checkpoint

            err.locate(self.current_step, latest_checkpoint(self.run_dir.path))
            raise
        finally:
            try:
                self.run_dir.plot_rewards()
            finally:
                self.trackers.close()
                self.executor.close()
                self.run_dir.unlock()
        return {"steps": cfg.run.steps, "run_dir": str(self.run_dir.path)}

    def _steps(self, signals: StopSignals) -> None:
        cfg = self.cfg
        last_saved = completed = self.start_step - 1
        in_update = False
        try:
            for step in range(self.start_step, cfg.run.steps + 1):
                self.current_step = step
                samples, reward_metrics = self.collect(step)
                with signals.deferred():
                    in_update = True
                    record = self.learn(step, samples, reward_metrics)
                    if self.eval_due(step):  # in the row before it is written: a resume truncates both alike
                        record.update(self.evaluate(step))
                    self.run_dir.append_metrics(record)
                    completed, in_update = step, False
                    if step % cfg.run.save_every == 0 or step == cfg.run.steps or signals.pending:
                        self.checkpoint(step)
                        last_saved = step
                if self.trackers:
                    self.trackers.log(step_event(step, record, samples, [e.name for e in cfg.rewards],
                                                 self._images(step), step_audio(self.run_dir.path, step,
                                                                                self.grid_due(step),
                                                                                self.eval_due(step))))
                if self.on_step:
                    self.on_step(record)
                signals.raise_pending()
        except KeyboardInterrupt:
            if in_update:  # a second signal in the update: its weights are half-way, nothing of it is saved
                log.warning("stopped during the update of step %d: that step is dropped; the run resumes from "
                            "step %d", completed + 1, last_saved)
            elif completed > last_saved:
                self.checkpoint(completed)
                last_saved = completed
            log.warning("interrupted: the last checkpoint holds step %d; rerun the same command to resume",
                        last_saved)
            raise
