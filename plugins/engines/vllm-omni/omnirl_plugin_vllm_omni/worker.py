"""Calls into vllm-omni's diffusion worker (``collective_rpc``) for weight sync, mixed into the worker class
by vllm-omni (``worker_extension_cls``). Tensors arrive as safetensors bytes: nothing engine-internal is
assumed about how the RPC serialises arguments."""

from __future__ import annotations

from typing import Any

from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

from omnirl_core.serving.rollout_server import unpack


def lora_module_names(state: dict[str, Any], flat_to_out: bool = True) -> dict[str, Any]:
    """peft names of the trainer's denoiser (diffusers layout) -> the names vLLM's LoRA loader parses
    (``base_model.model.<module>.lora_A.weight``) in vllm-omni's layout (Qwen-Image's ``to_out.0`` is ``to_out``
    there, ``flat_to_out``; FLUX.1's keeps ``to_out.0``; q/k/v stay separate: vllm-omni's LoRA manager slices them
    into its fused projections)."""
    out = {}
    for key, value in state.items():
        name = key.replace(".to_out.0.", ".to_out.") if flat_to_out else key
        out[f"base_model.model.{name}"] = value
    return out


class OmnirlWorkerExtension(CustomPipelineWorkerExtension):
    def omnirl_load_lora(self, adapter_id: int, peft_config: dict[str, Any], blob: bytes) -> int:
        """Replace adapter ``adapter_id`` by the LoRA in ``blob`` (loaded by the pipeline from these tensors,
        see ``OmnirlQwenImagePipeline._load_diffusion_lora_adapter``); returns the number of LoRA modules."""
        from vllm_omni.lora.request import LoRARequest

        _, tensors = unpack(blob)
        pipeline = self.model_runner.pipeline
        manager = self.lora_manager
        if manager is None:
            raise RuntimeError("vllm-omni started without its LoRA manager")
        flat = not any(name.endswith(".to_out.0") for name, _ in pipeline.transformer.named_modules())
        named = lora_module_names(tensors, flat)
        # the adapter's target modules by their last name in vllm-omni's layout (Qwen-Image: to_out.0 -> to_out)
        targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in named})
        pipeline.stage_lora(adapter_id, {**peft_config, "target_modules": targets}, named)
        if adapter_id in manager.list_adapters():
            manager.remove_adapter(adapter_id)
        manager.add_adapter(LoRARequest(lora_name=f"omnirl-{adapter_id}", lora_int_id=adapter_id,
                                        lora_path=f"/omnirl/in-memory/{adapter_id}"))
        return len(tensors) // 2

    def omnirl_drop_lora(self, adapter_id: int) -> bool:
        manager = self.lora_manager
        if manager is not None and adapter_id in manager.list_adapters():
            manager.set_active_adapter(None)
            return manager.remove_adapter(adapter_id)
        return False

    def omnirl_load_weights(self, blob: bytes) -> int:
        """Full denoiser weights (diffusers names) into vllm-omni's transformer; returns how many loaded.

        Once vllm-omni's LoRA manager has wrapped a layer, its weight is named ``<layer>.base_layer.weight``
        and the transformer's loader (which looks names up in ``named_parameters``) would skip it without a
        word: the loader sees the wrapped parameters under their plain names for this call."""
        _, tensors = unpack(blob)
        transformer = self.model_runner.pipeline.transformer
        wrapped = type(transformer).named_parameters

        def plain_names(module, *args, **kwargs):
            for name, param in wrapped(module, *args, **kwargs):
                yield name.replace(".base_layer.", "."), param

        transformer.named_parameters = plain_names.__get__(transformer)
        try:
            loaded = transformer.load_weights(iter(tensors.items()))
        finally:
            del transformer.named_parameters
        missing = [k for k in tensors if k not in loaded and not k.endswith(".bias")]
        if missing:
            raise RuntimeError(f"vllm-omni's transformer took no weight for {len(missing)} names, e.g. {missing[:3]}")
        return len(tensors)

    def omnirl_weight(self, name: str) -> bytes:
        """One transformer weight as vllm-omni holds it (its own layout: fused to_qkv, to_out), for checks."""
        from omnirl_core.serving.rollout_server import pack

        params = {k.replace(".base_layer.", "."): v for k, v in
                  self.model_runner.pipeline.transformer.named_parameters()}
        return pack({}, {"weight": params[name].detach().float().cpu()})
