"""Attention for the CPU platform: vllm-omni's TORCH_SDPA backend, whose CUDA path is plain torch.
vllm-omni dispatches attention per platform and has no CPU branch."""

from __future__ import annotations

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    """vllm-omni dispatches attention per platform and has no CPU branch; its SDPA path is plain torch."""

    def forward(self, query, key, value, attn_metadata=None):
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
