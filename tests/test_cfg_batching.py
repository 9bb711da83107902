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
