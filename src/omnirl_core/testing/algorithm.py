"""A test suite for flow-algorithm plugins, run on the core's toy flow model (``flow_toy.ToyFlowModel``), so
that an algorithm's tests import no model or engine plugin.

``check_algorithm_step(build)`` plays one RL step the way the runtime does: the controller's instance plans
the step, a rollout of groups of samples (``omnirl_core.testing.rollout``) is rewarded by brightness, the
controller's instance assigns advantages and builds the units, and a separate actor instance (as under Ray)
prepares and optimises them with the core's training helpers. An algorithm that declares
``controller_reads_trajectory = False`` gets the samples on the controller's side without their trajectories,
as a colocated Ray worker hands them out, and the actor's units get them back. It checks the contract (finite
loss, metrics that are numbers, a weight change) and returns the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnirl_core.config import RunConfig
    from omnirl_core.contracts import Sample


def check_algorithm_step(build: Callable[[RunConfig], object], height: int = 16, width: int = 16, num_steps: int = 3,
                         groups: int = 2, group_size: int = 4, lr: float = 1e-3) -> dict[str, float]:
    import torch

    from omnirl_core.algorithm import Algorithm
    from omnirl_core.config import LoraConfig, RunConfig
    from omnirl_core.loop.training import MetricMean, chunks, prepare_all, rs_corrections
    from omnirl_core.testing import _requests, rollout
    from omnirl_core.testing.flow_toy import ToyFlowModel

    config = RunConfig()
    config.rollout.num_steps, config.rollout.height, config.rollout.width = num_steps, height, width
    controller, actor = build(config), build(config)
    assert isinstance(controller, Algorithm) and isinstance(actor, Algorithm), \
        "an algorithm plugin returns a subclass of omnirl_core.algorithm.Algorithm"
    torch.manual_seed(0)
    model = ToyFlowModel()
    model.setup_training(LoraConfig(rank=4, alpha=4), need_reference=actor.uses_reference)
    plan = controller.plan(1)
    requests = []
    for g in range(groups):
        for k in range(group_size):
            (request,) = _requests([f"prompt {g}"], height, width, None, plan, 1.0, seed=100 * g + k)
            request.uid, request.group = g * group_size + k, g
            requests.append(request)
    samples = rollout(model, requests)
    held: dict[int, Sample] = {}
    if not controller.controller_reads_trajectory:
        # as a colocated Ray worker runs it: the controller's side gets each sample without its trajectory, and
        # the worker puts its own back into the units (omnirl_core.loop.ray_executor)
        from omnirl_core.loop.ray_executor import HELD_KEY, reward_view

        held = dict(enumerate(samples))
        samples = [reward_view(s) for s in samples]
        for key, s in enumerate(samples):
            s.extras[HELD_KEY] = key
    for s in samples:
        assert isinstance(s.output, torch.Tensor)
        s.reward = float(s.output.mean())
        s.rewards = {"brightness": s.reward}
    try:
        adv_metrics = controller.assign_advantages(samples)
        units = controller.training_units(samples)
    except (AttributeError, TypeError) as e:
        if held:
            raise AssertionError(
                f"{type(controller).__name__}.controller_reads_trajectory is False, but assign_advantages or "
                f"training_units read a sample's trajectory (latents, sigmas, logprobs, extras): {e}. Set it to "
                "True, or read only the request, output and rewards there.") from e
        raise
    assert units, "training_units returned nothing to train on"
    if held:
        from omnirl_core.loop.ray_executor import restore_trajectories

        assert restore_trajectories(units, held), "the units carry no held sample (unit.sample)"
    params = model.trainable_parameters()
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=lr)
    metrics = MetricMean()
    prepare_all(actor, model, units, 4, metrics)
    for micro in chunks(units, 4):
        loss, m = actor.loss(model, micro, first_update=True)
        assert loss.dim() == 0 and torch.isfinite(loss), f"loss must be a finite scalar, got {loss}"
        (loss * len(micro) / len(units)).backward()
        metrics.add({"loss": float(loss.detach()), **m}, len(micro))
    for micro in chunks(rs_corrections(actor, units, metrics), 4):
        loss, _ = actor.loss(model, micro, correction=True)
        (loss * len(micro) / len(units)).backward()
    optimizer.step()
    actor.after_update(model)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
    assert moved > 0, "one optimizer step left every trained weight unchanged (no gradient reached them)"
    out = {**adv_metrics, **metrics.result()}
    assert all(isinstance(v, float) for v in out.values()), out
    return out
