"""vllm-omni's Qwen-Image pipeline with omnirl's sampler steps (runs inside the engine's environment).

vllm-omni keeps its own text encoding, transformer call, step-wise request batching and VAE decode; this
subclass replaces what happens around them for a request that carries an omnirl rollout plan
(``prompt["omnirl"]``: one call's requests share their sampling parameters, the plan is per request):

- initial latent: drawn from the request's noise seed in the unpacked (C, H, W) layout, as the diffusers
  engine draws it, then packed;
- the schedule: the plan's sigmas (computed by the trainer's model, subsets included), given to the
  transformer as is (vllm-omni's own path scales timesteps by 1000 and back);
- each step: ``omnirl_core.flow.sampler.sample_step`` (the function the trainer re-evaluates with) with the
  plan's kind for that step (ODE / Flow-SDE / CPS / Dance-SDE / DPM2) and the request's own noise stream;
- the result: the trajectory x_0..x_T, sigmas, per-step log-probs (NaN for deterministic steps), the
  prompt embeddings the trainer re-evaluates with, and the decoded image in [0, 1], all in
  ``metadata["rl"]`` of the output envelope (CPU tensors).

A request without the omnirl plan (the engine's warm-up, plain serving) runs the parent's code unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from omnirl_core.flow.sampler import sample_step

KEY = "omnirl"


@dataclass(eq=False)
class _Track:
    """One request's rollout state beside vllm-omni's own."""

    uid: int
    shape: tuple[int, int, int]
    sigmas: torch.Tensor  # (T + 1,) fp32, host
    kinds: list[str]
    eta: float
    noise: torch.Generator  # the request's step noise (seed + 1, as in the diffusers engine)
    states: list[torch.Tensor]  # x_0 .. x_step, unpacked, host
    logprobs: torch.Tensor  # (T,) NaN for deterministic steps
    history: tuple[torch.Tensor, torch.Tensor] | None = None  # previous (x0 prediction, sigma): dpm2


def _pack(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    c, h, w = shape
    b = x.shape[0]
    x = x.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def _plan(prompt: Any) -> dict[str, Any] | None:
    return prompt.get(KEY) if isinstance(prompt, dict) else None


class OmnirlQwenImagePipeline(QwenImagePipeline):
    supports_step_execution = True

    def __init__(self, *, od_config: Any, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        self._omnirl_requests: set[str] = set()

    # -- step execution (vllm-omni batches the transformer calls of requests in flight) ------------------
    def prepare_encode(self, state: Any, **kwargs: Any) -> Any:
        plan = _plan(state.prompt)
        if plan is None:
            return super().prepare_encode(state, **kwargs)
        kinds = list(plan["step_kinds"])
        state.sampling.num_inference_steps = len(kinds)
        state = super().prepare_encode(state, **kwargs)  # prompt (and negative prompt) embeddings, CFG flags
        state.sampling.cfg_normalize = bool(plan.get("cfg_renorm", True))
        c, h, w = (int(v) for v in plan["latent_shape"])
        x = torch.randn((c, h, w), generator=torch.Generator().manual_seed(int(plan["noise_seed"])),
                        dtype=torch.float32)
        sigmas = torch.tensor(plan["sigmas"], dtype=torch.float32)
        state.latents = _pack(x[None]).to(self.device)
        state.timesteps = sigmas[:-1].to(self.device)
        state.extra[KEY] = _Track(
            uid=int(plan["uid"]), shape=(c, h, w), sigmas=sigmas, kinds=kinds, eta=float(plan["eta"]),
            noise=torch.Generator().manual_seed(int(plan["seed"]) + 1), states=[x],
            logprobs=torch.full((len(kinds),), float("nan")),
        )
        self._omnirl_requests.add(state.request_id)
        return state

    def _build_denoise_kwargs(self, latents: torch.Tensor, timestep: torch.Tensor, *args: Any, **kwargs: Any):
        positive, negative, output_slice = super()._build_denoise_kwargs(latents, timestep, *args, **kwargs)
        if self._omnirl_batch:
            # omnirl's timesteps are the sigmas themselves: hand them over unscaled (bit-exact)
            t = timestep.expand(latents.shape[0]).to(device=latents.device, dtype=latents.dtype)
            positive["timestep"] = t
            if negative is not None:
                negative["timestep"] = t
        return positive, negative, output_slice

    def denoise_step(self, input_batch: Any, **kwargs: Any) -> torch.Tensor | None:
        ids = list(getattr(input_batch, "request_ids", []))
        flags = {rid in self._omnirl_requests for rid in ids}
        if len(flags) > 1:
            raise RuntimeError("omnirl and plain requests in one denoise batch: their timesteps differ in scale")
        self._omnirl_batch = flags == {True}
        try:
            return super().denoise_step(input_batch, **kwargs)
        finally:
            self._omnirl_batch = False

    _omnirl_batch = False

    def step_scheduler(self, state: Any, noise_pred: torch.Tensor, **kwargs: Any) -> None:
        track: _Track | None = state.extra.get(KEY)
        if track is None:
            return super().step_scheduler(state, noise_pred, **kwargs)
        i = state.step_index
        kind = track.kinds[i]
        x = _unpack(state.latents.float(), track.shape)
        v = _unpack(noise_pred.float(), track.shape)
        device = x.device
        s = track.sigmas[i:i + 1].to(device)
        s_next = track.sigmas[i + 1:i + 2].to(device)
        sigma_max = track.sigmas[1:2].to(device)
        noise = None
        if kind != "ode":
            noise = torch.randn(track.shape, generator=track.noise)[None].to(device)
        history = None
        if kind == "dpm2":  # as the diffusers engine: no history yet = (zeros, sigma 1) = first order
            prev = track.history or (torch.zeros_like(x[0]), torch.ones((), device=device))
            history = (prev[0][None], prev[1].reshape(1))
        out = sample_step(kind, x, v, s, s_next, track.eta, noise, sigma_max, history)
        state.latents = _pack(out.prev_sample).to(state.latents.dtype)
        track.history = (out.x0[0], s[0])
        track.states.append(out.prev_sample[0].cpu())
        if out.logprob is not None:
            track.logprobs[i] = out.logprob[0].cpu()
        state.step_index += 1

    def post_decode(self, state: Any, **kwargs: Any) -> DiffusionOutput:
        track: _Track | None = state.extra.get(KEY)
        if track is None:
            return super().post_decode(state, **kwargs)
        self._omnirl_requests.discard(state.request_id)
        self._current_timestep = None
        x = track.states[-1][None].to(self.device)
        with torch.no_grad():
            vae = self.vae
            z = x.to(vae.dtype).unsqueeze(2)
            mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
            decoded = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        image = ((decoded.float() + 1) / 2).clamp(0, 1).cpu()
        rl = {
            "uid": track.uid,
            "latents": torch.stack(track.states),
            "sigmas": track.sigmas.clone(),
            "logprobs": track.logprobs,
            "image": image[0],
            "prompt_embeds": state.prompt_embeds[0].detach().float().cpu(),
            "prompt_mask": state.prompt_embeds_mask[0].detach().to(torch.long).cpu(),
        }
        if state.do_true_cfg:
            rl["negative_prompt_embeds"] = state.negative_prompt_embeds[0].detach().float().cpu()
            rl["negative_prompt_mask"] = state.negative_prompt_embeds_mask[0].detach().to(torch.long).cpu()
        state.extra.pop(KEY, None)
        # the envelope's payload goes through vllm-omni's image post-processing (PIL); metadata["rl"] does not
        return DiffusionOutput(output={"payload": {"image": decoded.cpu()}, "metadata": {"rl": rl}})

    # -- LoRA from tensors (vllm-omni's loader hook; the worker extension stages the tensors first) -------
    def stage_lora(self, adapter_id: int, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self._staged_lora = getattr(self, "_staged_lora", {})
        self._staged_lora[adapter_id] = (peft_config, tensors)

    def _load_diffusion_lora_adapter(self, lora_request: Any, lora_path: str, dtype: torch.dtype) -> Any:
        staged = getattr(self, "_staged_lora", {}).pop(lora_request.lora_int_id, None)
        if staged is None:
            return None  # an adapter on disk: vllm-omni's own loader
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        peft_config, tensors = staged
        helper = PEFTHelper.from_dict(dict(peft_config))
        model = LoRAModel.from_lora_tensors(lora_request.lora_int_id, tensors, helper, device="cpu", dtype=dtype,
                                            model_vocab_size=None, weights_mapper=None)
        return model, helper

    def forward(self, req: Any) -> Any:
        if any(_plan(p) is not None for p in req.prompts):
            raise RuntimeError("omnirl rollout requests need vllm-omni's step execution (step_execution=True); "
                               "the omnirl engine always starts it so")
        return super().forward(req)
