"""True CFG without grad runs both branches in one batched call (``guided_velocity(..., forward_pair)``); with
grad, the unconditional branch is a separate no-grad call. Both give the same guided velocity (the rollout's
and the trainer's numbers agree), and the batched path makes one transformer call instead of two."""

import torch

from omnirl_core.testing.flow_toy import ToyFlowModel


def test_batched_and_separate_cfg_agree_and_the_batched_path_makes_one_call():
    model = ToyFlowModel()
    prompts = ["a red square on a long white table", "a cat"]
    cond, uncond = model.encode(prompts), model.encode([" ", " "])
    x = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.8, 0.4])
    calls = []
    hook = model.denoiser.register_forward_hook(lambda mod, args, out: calls.append(1))
    with torch.no_grad():
        batched = model.velocity(x, s, cond, 4.5, uncond)
    assert len(calls) == 1
    calls.clear()
    separate = model.velocity(x, s, cond, 4.5, uncond)  # grad enabled: the training path
    assert len(calls) == 2
    hook.remove()
    err = (batched - separate.detach()).abs().max().item()
    assert err <= 1e-5, err
    with torch.no_grad():  # guidance 1: the conditional branch only, one call either way
        assert torch.equal(model.velocity(x, s, cond, 1.0, uncond), model.velocity(x, s, cond, 1.0, None))


def _guided_loss_grads(model, x, s, cond, uncond):
    model.denoiser.zero_grad()
    model.velocity(x, s, cond, 4.5, uncond).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.denoiser.named_parameters() if p.grad is not None}


def test_cfg_grad_both_backpropagates_through_the_unconditional_branch_in_one_call():
    from omnirl_core.flow.model import cfg_gradient

    model = ToyFlowModel()
    cond, uncond = model.encode(["a red square", "a cat"]), model.encode([" ", " "])
    x = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    s = torch.tensor([0.7, 0.3])
    calls = []
    hook = model.denoiser.register_forward_hook(lambda mod, args, out: calls.append(1))
    detached = _guided_loss_grads(model, x, s, cond, uncond)  # the default: cond
    assert len(calls) == 2
    calls.clear()
    with cfg_gradient("both"):
        both = _guided_loss_grads(model, x, s, cond, uncond)
    assert len(calls) == 1  # both branches in one batched call, with grad
    hook.remove()
    # the exact gradient of the guided velocity, written out: v_u + w (v_c - v_u) with both branches differentiated
    model.denoiser.zero_grad()
    v_c = model.velocity(x, s, cond)
    v_u = model.velocity(x, s, uncond)
    (v_u + 4.5 * (v_c - v_u)).square().sum().backward()
    exact = {n: p.grad.clone() for n, p in model.denoiser.named_parameters() if p.grad is not None}
    assert exact.keys() == both.keys()
    for name, grad in exact.items():
        scale = grad.abs().max().item() + 1e-12
        assert (both[name] - grad).abs().max().item() <= 1e-4 * scale, name
    # and the detached gradient is another one (the unconditional branch's share is missing)
    assert max((detached[n] - exact[n]).abs().max().item() / (exact[n].abs().max().item() + 1e-12)
               for n in exact) > 1e-2
    with torch.no_grad(), cfg_gradient("both"):  # no grad: the setting changes nothing
        assert model.velocity(x, s, cond, 4.5, uncond).requires_grad is False


def _update_with(tmp_path, cfg_grad: str):
    from omnirl_core.flow.model import CFG_GRAD
    from omnirl_core.loop.controller import Controller
    from omnirl_core.loop.worker import Worker
    from omnirl_core.plugins import PluginManager
    from omnirl_core.resolve import resolve_run

    manager = PluginManager()
    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                          "omnirl_plugin_diffusers", "omnirl_plugin_torch", "omnirl_plugin_color"])
    resolved = resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny", "lora": {"enabled": True, "rank": 4, "alpha": 4}},
        "algorithm": {"name": "flowgrpo", "options": {"beta": 0.0}},
        "rewards": [{"name": "color"}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "num_steps": 3, "height": 32, "width": 32,
                    "guidance_scale": 4.0},
        "train": {"lr": 3e-2, "minibatches": 1, "micro_batch_size": 8, "cfg_grad": cfg_grad},
        "run": {"seed": 5, "output_dir": str(tmp_path / cfg_grad), "device": "cpu"},
    }])
    controller = Controller(resolved, tmp_path / cfg_grad)
    worker = Worker(resolved, {"actor", "rollout"})
    worker.setup()
    samples = sorted(worker.generate(controller.requests(1)), key=lambda s: s.request.uid)
    for i, sample in enumerate(samples):
        sample.reward = float(i % 2)
    controller.algorithm.assign_advantages(samples)
    seen = []

    def spy(module, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append((torch.is_grad_enabled(), CFG_GRAD.get(), x.shape[0]))

    hook = worker.model.denoiser.register_forward_hook(spy, with_kwargs=True)
    worker.update(controller.algorithm.training_units(samples), 1)
    hook.remove()
    return worker.trained_state(), seen


def test_train_cfg_grad_reaches_the_training_forward(tmp_path):
    cond_state, cond_seen = _update_with(tmp_path, "cond")
    both_state, both_seen = _update_with(tmp_path, "both")
    assert {mode for grad, mode, _ in cond_seen if grad} == {"cond"}
    assert {mode for grad, mode, _ in both_seen if grad} == {"both"}
    # with grad, cond calls the conditional rows and, without grad, the unconditional ones apart; both calls
    # them together
    assert max(rows for grad, _, rows in both_seen if grad) == 2 * max(rows for grad, _, rows in cond_seen if grad)
    assert any(not torch.equal(cond_state[k], both_state[k]) for k in cond_state)  # another gradient, other weights
