"""Calls into vLLM's worker (``collective_rpc``) for weight sync, mixed into the worker class by vLLM
(``worker_extension_cls``). Tensors arrive as safetensors bytes: nothing is assumed about how vLLM's RPC
serialises arguments."""

from __future__ import annotations

from omnirl_core.serving.rollout_server import unpack


class OmnirlWorkerExtension:
    def omnirl_load_weights(self, blob: bytes) -> int:
        """Weights in the checkpoint's names and layout into the served model through vLLM's in-place reload
        (``reload_weights``, checkpoint format): each layer that receives weights is restored to its loading
        layout, loaded by the model's own loader (name mapping, q/k/v and gate/up fusion, sharding) and
        processed again into its kernel layout (e.g. the CPU build's prepacked linear and MoE weights).
        Returns how many tensors were sent."""
        _, tensors = unpack(blob)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def omnirl_packed_modules(self) -> dict[str, list[str]]:
        """vLLM's fused layers of the served model (e.g. ``qkv_proj: [q_proj, k_proj, v_proj]``): a weight sync
        sends all members of a fused layer together."""
        return {k: list(v) for k, v in getattr(self.model_runner.get_model(), "packed_modules_mapping", {}).items()}
