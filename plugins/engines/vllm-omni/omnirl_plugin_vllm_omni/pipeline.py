"""vllm-omni's Qwen-Image family with omnirl's sampler steps (runs inside the engine's environment).

vllm-omni keeps its own text (and image) encoding, transformer call, step-wise request batching and VAE decode;
the subclasses here (``OmnirlSteps``, a mixin, holds what they share) replace what happens around them for a
request that carries an omnirl rollout plan (``prompt["omnirl"]``: one call's requests share their sampling
parameters, the plan is per request):

- initial latent: drawn from the request's noise seed in the unpacked (C, H, W) layout, as the diffusers
  engine draws it, then packed;
- the schedule: the plan's sigmas (computed by the trainer's model, subsets included), given to the
  transformer as is (vllm-omni's own path scales timesteps by 1000 and back);
- each step: ``omnirl_core.flow.sampler.sample_step`` (the function the trainer re-evaluates with) with the
  plan's kind for that step (ODE / Flow-SDE / CPS / Dance-SDE / DPM2) and the request's own noise stream;
- the result: the trajectory x_0..x_T, sigmas, per-step log-probs (NaN for deterministic steps), the
  prompt embeddings the trainer re-evaluates with (an edit's: also its image latents and their grids), and the
  decoded image in [0, 1], all in ``metadata["rl"]`` of the output envelope (CPU tensors).

On Qwen-Image, a request without the omnirl plan (the engine's warm-up, plain serving) runs the parent's code
unchanged.

The edit pipelines (``QwenImageEditPlusPipeline``, ``QwenImageEditPipeline``) have no step execution of their own in
vllm-omni 0.30.0 (no ``prepare_encode`` / ``denoise_step`` / ``step_scheduler`` / ``post_decode``), while its runner
already batches what they need (each request's ``sampling.image_latent`` and ``img_shapes``) and
``QwenImagePipeline.denoise_step`` appends the image latents and keeps the noisy tokens' output. Their omnirl
subclasses take that denoise call from ``QwenImagePipeline`` as is, and encode each request's condition images in
``prepare_encode`` with the edit pipeline's own parts: its resize rule (``calculate_dimensions``) and image processor,
its ``encode_prompt`` (the Qwen2.5-VL encoder sees the images; its image processor on PIL, as the model plugin's)
and ``prepare_latents`` (the VAE, packed), at the pixel areas the trainer's model options give (vllm-omni's request
pre-processing fixes them at the released 1024 x 1024 and 384 x 384, and is not used: the images come in the plan).
A plain request (vllm-omni's start-up warm-up) runs on them as a rollout request of ODE steps that edits a black
picture.

FLUX.1 Kontext (``FluxKontextPipeline``) has only ``forward()`` in vllm-omni 0.30.0. Its omnirl subclass gives it the
step hooks from its own parts: ``prepare_encode`` calls its ``encode_prompt`` (CLIP pooled + T5, text ids), image
processor and ``prepare_latents`` (the source's VAE latents, packed, and the rotary ids of the noisy and source
tokens), at the source size the model plugin's resize rule gives (the request's ``condition_key``); ``denoise_step``
is one step of its ``diffuse()`` loop over the batch (its ``predict_noise``), the guidance scale as the transformer's
input; the decode is its forward's (``/ scaling_factor + shift_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.flux.pipeline_flux_kontext import FluxKontextPipeline
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit import (
    QwenImageEditPipeline,
    calculate_dimensions,
)
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus import QwenImageEditPlusPipeline

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
    condition: dict[str, torch.Tensor] = field(default_factory=dict)  # an edit's image latents and grids, host


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


def _plain_as_rollout(state: Any, channels: int, scale: int, **fields: Any) -> None:
    """Gives a plain request (vllm-omni's start-up warm-up) a rollout plan: ODE steps on a linear schedule at the
    request's size, with ``fields`` added to the plan."""
    sampling = state.sampling
    steps, height, width = sampling.num_inference_steps or 2, sampling.height, sampling.width
    prompt = state.prompt if isinstance(state.prompt, dict) else {"prompt": state.prompt or ""}
    state.prompt = {**prompt, KEY: {
        "uid": -1, "step_kinds": ["ode"] * steps, "eta": 0.0, "seed": 0, "noise_seed": 0,
        "sigmas": torch.linspace(1.0, 0.0, steps + 1).tolist(),
        "latent_shape": [channels, height // scale, width // scale], **fields,
    }}


class OmnirlSteps:
    """omnirl's rollout hooks on a vllm-omni Qwen-Image-family pipeline (listed before the pipeline class); a subclass
    writes ``_omnirl_condition``: the request's conditioning on ``state`` (embeddings, CFG flags, image shapes)."""

    supports_step_execution = True

    def __init__(self, *, od_config: Any, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        self._omnirl_requests: set[str] = set()

    def _omnirl_condition(self, state: Any, plan: dict[str, Any], latents: torch.Tensor,
                          **kwargs: Any) -> dict[str, torch.Tensor]:
        """Encode the request onto ``state``; returns what the sample carries besides the text embeddings."""
        raise NotImplementedError

    # -- step execution (vllm-omni batches the transformer calls of requests in flight) ------------------
    def prepare_encode(self, state: Any, **kwargs: Any) -> Any:
        plan = _plan(state.prompt)
        if plan is None:
            return super().prepare_encode(state, **kwargs)
        kinds = list(plan["step_kinds"])
        state.sampling.num_inference_steps = len(kinds)
        c, h, w = (int(v) for v in plan["latent_shape"])
        x = torch.randn((c, h, w), generator=torch.Generator().manual_seed(int(plan["noise_seed"])),
                        dtype=torch.float32)
        latents = _pack(x[None]).to(self.device)
        condition = self._omnirl_condition(state, plan, latents, **kwargs)
        state.sampling.cfg_normalize = bool(plan.get("cfg_renorm", True))
        sigmas = torch.tensor(plan["sigmas"], dtype=torch.float32)
        state.latents = latents
        state.timesteps = sigmas[:-1].to(self.device)
        state.step_index = 0
        state.extra[KEY] = _Track(
            uid=int(plan["uid"]), shape=(c, h, w), sigmas=sigmas, kinds=kinds, eta=float(plan["eta"]),
            noise=torch.Generator().manual_seed(int(plan["seed"]) + 1), states=[x],
            logprobs=torch.full((len(kinds),), float("nan")), condition=condition,
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
            decoded = self._omnirl_decode(x)
        image = ((decoded.float() + 1) / 2).clamp(0, 1).cpu()
        rl = {
            "uid": track.uid,
            "latents": torch.stack(track.states),
            "sigmas": track.sigmas.clone(),
            "logprobs": track.logprobs,
            "image": image[0],
            "prompt_embeds": state.prompt_embeds[0].detach().float().cpu(),
            **track.condition,
        }
        if state.prompt_embeds_mask is not None:
            rl["prompt_mask"] = state.prompt_embeds_mask[0].detach().to(torch.long).cpu()
        if state.do_true_cfg:
            rl["negative_prompt_embeds"] = state.negative_prompt_embeds[0].detach().float().cpu()
            rl["negative_prompt_mask"] = state.negative_prompt_embeds_mask[0].detach().to(torch.long).cpu()
        state.extra.pop(KEY, None)
        # the envelope's payload goes through vllm-omni's image post-processing (PIL); metadata["rl"] does not
        return DiffusionOutput(output={"payload": {"image": decoded.cpu()}, "metadata": {"rl": rl}})

    def _omnirl_decode(self, x: torch.Tensor) -> torch.Tensor:
        """Unpacked latents (1, C, H, W) -> the VAE's output (1, 3, H', W') in [-1, 1]: Qwen-Image's VAE (one frame,
        per-channel mean and std)."""
        vae = self.vae
        z = x.to(vae.dtype).unsqueeze(2)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        return vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]

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


class OmnirlQwenImagePipeline(OmnirlSteps, QwenImagePipeline):
    def _omnirl_condition(self, state: Any, plan: dict[str, Any], latents: torch.Tensor,
                          **kwargs: Any) -> dict[str, torch.Tensor]:
        # vllm-omni's own preparation: prompt (and negative prompt) embeddings, CFG flags, image shape
        QwenImagePipeline.prepare_encode(self, state, **kwargs)
        return {}


class _QwenImageDenoise:
    """What vllm-omni 0.30.0's edit pipelines lack for step execution, taken from ``QwenImagePipeline`` as is: the
    batched denoise call (``image_latents`` appended to the noisy tokens, their output kept) and its arguments."""

    denoise_step = QwenImagePipeline.denoise_step
    _build_denoise_kwargs = QwenImagePipeline._build_denoise_kwargs


class _OmnirlEdit(OmnirlSteps, _QwenImageDenoise):
    """A Qwen-Image-Edit request's conditioning, encoded by the edit pipeline's own parts: the prompt with its images
    (``encode_prompt``: the vision-language encoder), the images' VAE latents packed (``prepare_latents``), and the
    image shapes (RoPE frames) of the noisy tokens and each condition image."""

    def __init__(self, *, od_config: Any, prefix: str = ""):
        import os

        from transformers import AutoImageProcessor

        super().__init__(od_config=od_config, prefix=prefix)
        self._interrupt = False  # what the edit pipelines set in forward() and QwenImagePipeline.denoise_step reads
        self._attention_kwargs: dict[str, Any] = {}
        self._current_timestep = None
        # The vision tower's inputs as the model plugin makes them (the checkpoint's image processor on PIL):
        # transformers loads it on its torchvision backend where torchvision imports, whose resize differs from
        # PIL's (0.015 in the normalised pixels of a 96 x 32 source at the tiny preset's sizes).
        self.processor.image_processor = AutoImageProcessor.from_pretrained(
            od_config.model, subfolder="processor", backend="pil", local_files_only=os.path.isdir(od_config.model))

    def _omnirl_sources(self, images: list[Any], vae_area: int, vl_area: int) -> tuple[Any, Any, list[tuple[int, int]]]:
        """(what ``encode_prompt`` reads, what ``prepare_latents`` encodes, each image's (w, h) for the VAE)."""
        raise NotImplementedError

    def prepare_encode(self, state: Any, **kwargs: Any) -> Any:
        if _plan(state.prompt) is None:
            # vllm-omni's start-up warm-up (a plain text request) and any plain request: with no step path of the
            # edit pipelines' own to run it, it runs as a rollout request: ODE steps on a linear schedule, editing a
            # black picture of the output's size (what vllm-omni's warm-up sends an image-input model)
            height, width = state.sampling.height, state.sampling.width
            _plain_as_rollout(state, self.transformer.in_channels // 4, self.vae_scale_factor,
                              images=[torch.zeros((height, width, 3), dtype=torch.uint8)],
                              vae_image_area=height * width, vl_image_area=height * width)
        return super().prepare_encode(state, **kwargs)

    def _omnirl_condition(self, state: Any, plan: dict[str, Any], latents: torch.Tensor,
                          **kwargs: Any) -> dict[str, torch.Tensor]:
        from PIL import Image

        sampling = state.sampling
        images = [Image.fromarray(pixels.numpy()) for pixels in plan["images"]]
        if not images:
            raise RuntimeError("an edit request needs its condition image(s)")
        vl, vae_input, vae_sizes = self._omnirl_sources(images, int(plan["vae_image_area"]),
                                                        int(plan["vl_image_area"]))
        length = sampling.max_sequence_length or self.tokenizer_max_length
        state.prompt_embeds, state.prompt_embeds_mask = self.encode_prompt(
            prompt=state.prompt["prompt"], image=vl, max_sequence_length=length)
        negative = state.prompt.get("negative_prompt")
        state.do_true_cfg = (sampling.true_cfg_scale or 1.0) > 1 and negative is not None
        if state.do_true_cfg:  # the negative prompt sees the same images
            state.negative_prompt_embeds, state.negative_prompt_embeds_mask = self.encode_prompt(
                prompt=negative, image=vl, max_sequence_length=length, prompt_name="negative_prompt")
        _, image_latents = self.prepare_latents(vae_input, 1, self.transformer.in_channels // 4, sampling.height,
                                                sampling.width, state.prompt_embeds.dtype, self.device, None, latents)
        sampling.image_latent = image_latents
        scale = self.vae_scale_factor * 2
        grids = [(vh // scale, vw // scale) for vw, vh in vae_sizes]
        state.img_shapes = [[(1, sampling.height // scale, sampling.width // scale), *((1, h, w) for h, w in grids)]]
        state.guidance = None  # the edit checkpoints guide by true CFG only (no guidance embedding)
        return {"image_latents": image_latents[0].detach().float().cpu(),
                "image_grids": torch.tensor(grids, dtype=torch.long)}


class OmnirlQwenImageEditPlusPipeline(_OmnirlEdit, QwenImageEditPlusPipeline):
    def _omnirl_sources(self, images: list[Any], vae_area: int, vl_area: int) -> tuple[Any, Any, list[tuple[int, int]]]:
        # as vllm-omni's Edit-Plus pre-processing: the vision tower sees each image at vl_area, the VAE at vae_area
        vl, vae, sizes = [], [], []
        for image in images:
            ratio = image.width / image.height
            cw, ch = calculate_dimensions(vl_area, ratio)
            vw, vh = calculate_dimensions(vae_area, ratio)
            vl.append(self.image_processor.resize(image, ch, cw))
            vae.append(self.image_processor.preprocess(image, vh, vw).unsqueeze(2))
            sizes.append((vw, vh))
        return vl, vae, sizes


class OmnirlQwenImageEditPipeline(_OmnirlEdit, QwenImageEditPipeline):
    def _omnirl_sources(self, images: list[Any], vae_area: int, vl_area: int) -> tuple[Any, Any, list[tuple[int, int]]]:
        # as vllm-omni's Edit pre-processing: one image, resized to vae_area, which the vision tower sees too
        if len(images) != 1:
            raise RuntimeError(f"Qwen-Image-Edit takes one condition image; the request has {len(images)}")
        (image,) = images
        vw, vh = calculate_dimensions(vae_area, image.width / image.height)
        image = self.image_processor.resize(image, vh, vw)
        return image, self.image_processor.preprocess(image, vh, vw).unsqueeze(2), [(vw, vh)]


class _KontextDenoise:
    """The step-execution transformer call vllm-omni 0.30.0's ``FluxKontextPipeline`` lacks: one step of its
    ``diffuse()`` loop over the batch's rows, through its own ``predict_noise`` (its transformer): the noisy tokens
    followed by the source's (``image_latents``), rotary ids of both, the pooled CLIP and T5 embeddings, the embedded
    guidance; the noisy tokens' output. The per-request parts the runner does not gather (pooled embeddings, ids) ride
    on each request's ``state.extra``; the ids must be equal across the batch (the server's calls share the output size
    and the source's latent grid)."""

    def denoise_step(self, input_batch: Any, **kwargs: Any) -> torch.Tensor | None:
        if self.interrupt:
            return None
        if input_batch.do_true_cfg:
            raise RuntimeError("FLUX.1 Kontext runs here with embedded guidance only (no true CFG branch)")
        parts = [state.extra[KONTEXT] for state in input_batch.states]
        first = parts[0]
        if any(not (torch.equal(p["txt_ids"], first["txt_ids"]) and torch.equal(p["img_ids"], first["img_ids"]))
               for p in parts[1:]):
            raise RuntimeError("requests with different token layouts in one FLUX.1 Kontext denoise batch")
        latents = input_batch.latents
        hidden = latents if input_batch.image_latents is None else torch.cat([latents, input_batch.image_latents], 1)
        t = input_batch.timesteps
        self._current_timestep = t
        # omnirl's timesteps are the sigmas; the model plugin hands the transformer (1000 sigma) / 1000
        timestep = (t.float() * 1000).to(latents.dtype) / 1000
        out = self.predict_noise(
            hidden_states=hidden, timestep=timestep, guidance=input_batch.guidance,
            pooled_projections=torch.cat([p["pooled"] for p in parts]), encoder_hidden_states=input_batch.prompt_embeds,
            txt_ids=first["txt_ids"], img_ids=first["img_ids"], joint_attention_kwargs={}, return_dict=False)
        return out[:, :latents.shape[1]]


KONTEXT = "omnirl.kontext"


class OmnirlFluxKontextPipeline(OmnirlSteps, _KontextDenoise, FluxKontextPipeline):
    """FLUX.1 Kontext with omnirl's steps. ``prepare_encode`` encodes a request with the pipeline's own parts: its
    ``encode_prompt`` (CLIP pooled + T5; the text ids), its image processor (resize to the source's size: the latent
    grid the model plugin's ``condition_key`` gives, sent with the request) and ``prepare_latents`` (the VAE, shift
    and scale, packing; the noisy and source tokens' rotary ids, the source's first id 1). The guidance scale goes in
    as the transformer's guidance input (``state.guidance``: the runner gathers it per row). A plain request
    (vllm-omni's start-up warm-up) runs as a rollout request of ODE steps without a source."""

    def __init__(self, *, od_config: Any, prefix: str = ""):
        import os

        from transformers import AutoTokenizer

        super().__init__(od_config=od_config, prefix=prefix)
        self._joint_attention_kwargs = {}
        # The tokenizers as the checkpoint names them (what diffusers, hence the model plugin, loads): vllm-omni loads
        # CLIPTokenizer / T5TokenizerFast whatever the checkpoint holds, and transformers 5's CLIPTokenizer rebuilds
        # its own pre-tokenisation, which splits a tokenizer trained otherwise (the tiny preset's) into other ids.
        local = os.path.isdir(od_config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(od_config.model, subfolder="tokenizer", local_files_only=local)
        self.tokenizer_2 = AutoTokenizer.from_pretrained(od_config.model, subfolder="tokenizer_2",
                                                         local_files_only=local)
        # vllm-omni's LoRA manager finds which fused projection takes an adapter's to_q / to_k / to_v in a module's
        # ``stacked_params_mapping`` attribute; FLUX.1's transformer declares the fusion as ``packed_modules_mapping``
        # only (its load_weights keeps the stacked mapping local), so the q/k/v LoRA would bind nowhere.
        transformer = self.transformer
        if getattr(transformer, "stacked_params_mapping", None) is None:
            transformer.stacked_params_mapping = [
                (f".{packed}", f".{sub}", shard) for packed, subs in transformer.packed_modules_mapping.items()
                for sub, shard in zip(subs, ("q", "k", "v"), strict=True)]

    @property
    def device(self) -> torch.device:
        return self._execution_device

    def prepare_encode(self, state: Any, **kwargs: Any) -> Any:
        if _plan(state.prompt) is None:  # the warm-up, as for the Qwen edit pipelines
            _plain_as_rollout(state, self.transformer.in_channels // 4, self.vae_scale_factor, guidance_scale=1.0)
        return super().prepare_encode(state, **kwargs)

    def _omnirl_condition(self, state: Any, plan: dict[str, Any], latents: torch.Tensor,
                          **kwargs: Any) -> dict[str, torch.Tensor]:
        from PIL import Image

        sampling = state.sampling
        embeds, pooled, text_ids = self.encode_prompt(
            prompt=state.prompt["prompt"], device=self.device, max_sequence_length=sampling.max_sequence_length or 512)
        state.prompt_embeds, state.prompt_embeds_mask = embeds, None
        state.do_true_cfg = False
        state.guidance = float(plan["guidance_scale"]) if self.transformer.guidance_embeds else None
        source, grids = None, []
        images = plan.get("images") or []
        if len(images) > 1:
            raise RuntimeError(f"FLUX.1 Kontext takes one source image; the request has {len(images)}")
        if images:  # at the size the model plugin's resize rule gives (its condition_key: the source's latent grid)
            (h, w), = plan["condition_key"]
            height, width = h * self.vae_scale_factor * 2, w * self.vae_scale_factor * 2
            image = self.image_processor.resize(Image.fromarray(images[0].numpy()), height, width)
            source = self.image_processor.preprocess(image, height, width)
            grids = [(h, w)]
        _, image_latents, latent_ids, image_ids = self.prepare_latents(
            source, 1, self.transformer.in_channels // 4, sampling.height, sampling.width, embeds.dtype, self.device,
            None, latents)
        sampling.image_latent = image_latents
        ids = latent_ids if image_ids is None else torch.cat([latent_ids, image_ids])
        state.extra[KONTEXT] = {"pooled": pooled, "txt_ids": text_ids, "img_ids": ids}
        condition = {"pooled_prompt_embeds": pooled[0].detach().float().cpu(),
                     "image_grids": torch.tensor(grids, dtype=torch.long).reshape(-1, 2)}
        negative = state.prompt.get("negative_prompt")
        if negative is not None and float(plan["guidance_scale"]) > 1.0:
            # the negative prompt's conditioning, which omnirl's samples carry with a scale above 1 (as the diffusers
            # engine's do); embedded guidance runs no unconditional branch
            negative_embeds, negative_pooled, _ = self.encode_prompt(
                prompt=negative, device=self.device, max_sequence_length=sampling.max_sequence_length or 512)
            condition["negative_prompt_embeds"] = negative_embeds[0].detach().float().cpu()
            condition["negative_pooled_prompt_embeds"] = negative_pooled[0].detach().float().cpu()
        if image_latents is not None:
            condition["image_latents"] = image_latents[0].detach().float().cpu()
        return condition

    def _omnirl_decode(self, x: torch.Tensor) -> torch.Tensor:
        vae = self.vae  # the pipeline's denormalisation (its forward's): / scaling + shift
        z = x.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z, return_dict=False)[0]

    def post_decode(self, state: Any, **kwargs: Any) -> DiffusionOutput:
        out = super().post_decode(state, **kwargs)
        state.extra.pop(KONTEXT, None)
        return out
