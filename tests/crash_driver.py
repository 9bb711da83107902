"""Runs ``omnirl`` with a signal armed at one point of the run (for ``test_crash_consistency.py``).

    python tests/crash_driver.py POINT STEP SIGNAL -- omnirl-arguments...

The signal is real: the process sends it to itself (SIGKILL ends it on the spot; SIGINT goes through the
handler a user's Ctrl-C reaches). The points wrap functions of the core from the outside, so the run's own
code is what it is in production:

  collect        start of step STEP's rollout
  reward         inside a reward call of step STEP (from a reward thread)
  optimizer      right after the first optimizer step of step STEP (minibatch 1 of 2 applied)
  optimizer-2x   two signals there: the first is deferred, the second stops at once
  sync           during the weight sync of step STEP (after the update)
  row            after step STEP's metrics row, before its checkpoint
  ckpt-write     while checkpoint STEP is written (weights on disk, manifest not)
  ckpt-latest    after checkpoint STEP is renamed into place, before ``latest`` names it
  load           while the resumed run loads its checkpoint
  prepare        while a (resumed) run rewrites its config
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def main() -> None:
    point, step, signame = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = sys.argv[sys.argv.index("--") + 1:]
    signum = {"KILL": signal.SIGKILL, "INT": signal.SIGINT, "TERM": signal.SIGTERM}[signame]
    state = {"step": 0, "fired": False, "optimizer_calls": 0}

    def fire(times: int = 1) -> None:
        if state["fired"]:
            return
        state["fired"] = True
        for _ in range(times):
            os.kill(os.getpid(), signum)
            threading.Event().wait(0.2)  # lets the main thread's handler run between two signals

    from omnirl_core.loop import controller
    from omnirl_core.rundir import checkpoint
    from omnirl_core.rundir import rundir as tracking

    collect = controller.Controller.collect

    def collect_hook(self, k):
        state["step"] = k
        if point == "collect" and k == step:
            fire()
        return collect(self, k)

    controller.Controller.collect = collect_hook

    if point == "reward":
        from omnirl_core.rewards import dispatch as rewards

        score = rewards.RewardSet.score

        def score_hook(self, samples):
            if state["step"] == step:
                fire()
            return score(self, samples)

        rewards.RewardSet.score = score_hook

    if point.startswith("optimizer"):
        import torch

        adam_step = torch.optim.AdamW.step

        def step_hook(self, *a, **kw):
            out = adam_step(self, *a, **kw)
            if state["step"] == step:
                fire(2 if point == "optimizer-2x" else 1)
            return out

        torch.optim.AdamW.step = step_hook

    if point == "sync":
        from omnirl_core.loop import executors

        sync = executors.InlineExecutor.sync_weights

        def sync_hook(self):
            if state["step"] == step:
                fire()
            return sync(self)

        executors.InlineExecutor.sync_weights = sync_hook

    if point == "row":
        append = tracking.RunDir.append_metrics

        def append_hook(self, record):
            append(self, record)
            if record["step"] == step:
                fire()

        tracking.RunDir.append_metrics = append_hook

    if point == "ckpt-write":
        digest = checkpoint.sha256

        def sha_hook(path):
            if state["step"] == step and not path.name.startswith("checksums"):
                fire()
            return digest(path)

        checkpoint.sha256 = sha_hook

    if point == "ckpt-latest":
        write = checkpoint.write_atomic

        def write_hook(path, data):
            if path.name == "latest" and state["step"] == step:
                fire()
            return write(path, data)

        checkpoint.write_atomic = write_hook

    if point == "load":
        load = checkpoint.load_checkpoint

        def load_hook(path, read_state):
            def reading(directory):
                fire()
                return read_state(directory)

            return load(path, reading)

        checkpoint.load_checkpoint = load_hook  # the controller imports it when it sets up

    if point == "prepare":
        prepare = tracking.RunDir.prepare

        def prepare_hook(self, config, plugins):
            fire()
            return prepare(self, config, plugins)

        tracking.RunDir.prepare = prepare_hook

    from omnirl_cli.main import run

    sys.argv = ["omnirl", *args]
    run()


if __name__ == "__main__":
    main()
