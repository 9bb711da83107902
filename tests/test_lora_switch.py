"""``omnirl_core.lora.adapters_disabled``: the reference policy of a LoRA run. Inside it the model computes
as its base model; after it, with its adapters again, which train (peft's switch turns their grads off and on)."""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model

from omnirl_core.lora import adapters_disabled, lora_layers


def test_adapters_off_inside_on_after_and_trainable_again():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    x = torch.randn(4, 6)
    want_base = base(x).detach()
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["0", "2"]), base)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # peft starts B at zero: make the adapter change the output
    with_adapter = model(x).detach()
    assert not torch.allclose(with_adapter, want_base)
    layers = lora_layers(model)
    assert len(layers) == 2
    for found in (None, layers):  # found here, or handed over (the flow model caches them)
        with adapters_disabled(model, found):
            assert torch.equal(model(x), want_base)
        assert torch.equal(model(x), with_adapter)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        assert lora and all(p.requires_grad for p in lora)
