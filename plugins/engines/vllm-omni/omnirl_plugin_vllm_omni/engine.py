"""The trainer-side half of the vllm-omni rollout engine: no vllm import here.

The engine runs vllm-omni in a server process of its own, in the environment ``omnirl env build vllm-omni``
builds (``omnirl_core.serving.envs``), and talks to it over 127.0.0.1 (``omnirl_core.serving.rollout_server``:
safetensors + JSON, no pickle). This side turns ``GenRequest``s into requests that carry the rollout plan
(sampler kind per step, eta, the model's sigmas for the plan, seeds; an edit's condition images as pixels), and
the server's results back into ``Sample``s with the trajectory, log-probs, the engine's conditioning (what the
trainer re-evaluates with: prompt embeddings, an edit's image latents and their grids) and the image.

The pipeline class follows the checkpoint (``model_index.json``'s ``_class_name``, see ``PIPELINES``): Qwen-Image,
Qwen-Image-Edit-Plus, Qwen-Image-Edit and FLUX.1 Kontext; another model is refused before the server starts.

Weight sync: before a rollout, when the trained weights changed since the last push (torch's in-place
version counters of the trainable parameters), they go to the engine: the LoRA tensors through vllm-omni's
adapter API (loaded from tensors, no files), or the full denoiser (``weight_sync: full``; with LoRA the
adapter merged into the base weights).

One server per (environment, model directory, engine arguments) per process (``shared_server``), shared by every
engine object that asks for the same: tests and repeated runs in one process start vllm-omni once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from omnirl_core.contracts import Conditioning, GenRequest, Sample
from omnirl_core.errors import UsageError
from omnirl_core.serving.rollout_server import ServedEngineOptions, ServedRolloutEngine
from omnirl_core.weights import merged_weights

SERVER_MODULE = "omnirl_plugin_vllm_omni.server"
PIPELINES = {
    "QwenImagePipeline": "OmnirlQwenImagePipeline",
    "QwenImageEditPlusPipeline": "OmnirlQwenImageEditPlusPipeline",
    "QwenImageEditPipeline": "OmnirlQwenImageEditPipeline",
    "FluxKontextPipeline": "OmnirlFluxKontextPipeline",
}
"""A checkpoint's pipeline (its ``model_index.json`` ``_class_name``) -> the class of ``pipeline.py`` that runs it."""
NO_STEP_EXECUTION = ("FluxPipeline",)
"""Pipelines vllm-omni 0.30.0 ships without step execution (no prepare_encode / denoise_step / step_scheduler /
post_decode), which omnirl's per-step sampler needs, and that ``pipeline.py`` does not give it."""
VLLM_OMNI_IMAGE_AREAS = {"vae_image_area": 1024 * 1024, "vl_image_area": 384 * 384}
"""The edit pipelines' own condition-image areas in pixels (what a model without such options gets)."""


class VllmOmniRolloutOptions(ServedEngineOptions):
    max_num_seqs: int = Field(32, ge=1, description="Most requests vllm-omni steps together (its step-wise batching).")


def model_directory(model: Any) -> str:
    """The local directory the trainer's model was loaded from (what vllm-omni loads too)."""
    pipeline = getattr(model, "pipeline", None)
    path = getattr(pipeline, "name_or_path", None) or getattr(getattr(pipeline, "config", None), "_name_or_path", None)
    if not path or not Path(path).is_dir():
        raise UsageError(
            f"The vllm-omni engine loads the model from a local directory; the model was loaded from {path!r}.",
            hint="Download the checkpoint (huggingface-cli download ...) and set model.path to its directory.",
        )
    return str(Path(path).resolve())


def pipeline_class(directory: str) -> str:
    """The class of ``pipeline.py`` that runs the checkpoint in ``directory``; a UsageError for another model."""
    index = Path(directory) / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    if name in PIPELINES:
        return PIPELINES[name]
    why = (f"vllm-omni 0.30.0's {name} has no step execution (prepare_encode, denoise_step, step_scheduler, "
           "post_decode), which omnirl's per-step sampler needs" if name in NO_STEP_EXECUTION else
           f"it holds a {name} checkpoint" if name else "it has no diffusers model_index.json")
    raise UsageError(
        f"The vllm-omni engine cannot run the model in {directory}: {why}.",
        hint=f"It runs {', '.join(sorted(PIPELINES))} checkpoints; use rollout.engine=diffusers for this model.",
    )


def _pixels(path: str) -> Any:
    """A condition image as the model reads it (RGB), its pixels (H, W, 3) uint8: the engine resizes them."""
    import numpy as np
    import torch

    from omnirl_core.data.images import load_image

    return torch.from_numpy(np.array(load_image(path), dtype=np.uint8))


def _plan_fields(request: GenRequest, sigmas: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    plan = request.plan
    return {
        "uid": request.uid,
        "prompt": request.prompt,
        "height": request.height,
        "width": request.width,
        "guidance_scale": float(request.guidance_scale),
        "step_kinds": list(plan.step_kinds),
        "eta": float(plan.eta),
        "sigmas": [float(s) for s in sigmas],  # fp32 values, exact as doubles
        "latent_shape": list(shape),
        "seed": int(request.seed),
        "noise_seed": int(request.noise_seed if request.noise_seed is not None else request.seed),
    }


class VllmOmniRolloutEngine(ServedRolloutEngine):
    name = "vllm-omni"
    server_module = SERVER_MODULE
    fallback = "diffusers"

    def __init__(self, model: Any, options: VllmOmniRolloutOptions | None, device: Any):
        self.start_served(model, options or VllmOmniRolloutOptions(), device, "vllm-omni")
        self.directory = model_directory(model)
        pipeline = pipeline_class(self.directory)
        if self.device_kind == "cpu":
            self.env_vars["OMNIRL_VLLM_OMNI_CPU"] = "1"
        dtype = str(getattr(model, "dtype", "float32")).replace("torch.", "")
        self.args = ["--model", self.directory, "--dtype", dtype, "--max-num-seqs", str(self.options.max_num_seqs),
                     "--pipeline", pipeline]
        self._sigmas: dict[tuple, Any] = {}

    # -- weight sync ---------------------------------------------------------------------------
    def push_weights(self) -> tuple[dict[str, Any], dict[str, float]]:
        lora = getattr(self.model, "lora", None)
        if lora is not None and self.options.weight_sync == "auto":
            from peft.utils import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model.denoiser)
            meta = {"rank": lora.rank, "alpha": lora.alpha}  # the worker names the target modules
            self.server.call("load_lora", meta, state, timeout_s=self.options.request_timeout_s)
        else:
            state = self._full_state()
            self.server.call("load_weights", {}, state, timeout_s=self.options.request_timeout_s)
        return state, {}

    def _full_state(self) -> dict[str, Any]:
        """The denoiser's weights in diffusers names; a LoRA adapter merged in (base + scale B A)."""
        return merged_weights(self.model.denoiser)

    # -- rollout -------------------------------------------------------------------------------
    def _schedule(self, request: GenRequest, shape: tuple[int, ...]) -> Any:
        key = (request.plan.schedule_steps, shape)
        if key not in self._sigmas:
            import torch

            self._sigmas[key] = self.model.sigmas(request.plan.schedule_steps, shape).to(torch.float32).cpu()
        return request.plan.sigmas_from(self._sigmas[key])

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Every request through vllm-omni (its step-wise batching); samples in the order of ``requests``."""
        if not requests:
            return
        self.sync_weights()
        options = getattr(self.model, "options", None)
        common = {
            "negative_prompt": getattr(self.model, "negative_prompt", " "),
            "cfg_renorm": bool(getattr(options, "cfg_renorm", True)),
            "guidance": getattr(self.model, "guidance", "cfg"),  # embedded (FLUX.1): the scale goes in, no CFG
            "max_sequence_length": int(getattr(options, "max_sequence_length", 512)),
            # an edit model's resize rule: the areas its options give, else the pipelines' own
            **{k: int(getattr(options, k, v)) for k, v in VLLM_OMNI_IMAGE_AREAS.items()},
        }
        fields, pixels = [], {}
        for r in requests:
            shape = tuple(self.model.latent_shape(r.height, r.width, r.num_frames))
            fields.append(_plan_fields(r, self._schedule(r, shape).tolist(), shape))
            if getattr(self.model, "condition_images", 0) > 0:
                fields[-1].update(self._sources(r, pixels))
        meta, tensors = self.server.call("generate", {"requests": fields, **common}, pixels,
                                         timeout_s=self.options.request_timeout_s)
        self.last_stats = meta.get("stats", {})
        for r in requests:
            yield self._sample(r, tensors)

    def _sources(self, request: GenRequest, pixels: dict[str, Any]) -> dict[str, Any]:
        """An edit request's condition images: their pixels into ``pixels``, their names there and their latent
        grids (the model's ``condition_key``, which buckets the requests that share a transformer call) as plan
        fields."""
        paths = request.condition_images
        if not 1 <= len(paths) <= self.model.condition_images:
            raise UsageError(
                f"The vllm-omni engine runs an edit with one to {self.model.condition_images} condition image(s) per "
                f"prompt; the prompt {request.prompt[:60]!r} has {len(paths)}.",
                hint="Give every prompt record its source in the 'image' field, or use rollout.engine=diffusers.")
        keys = []
        for path in paths:  # each picture once per call: a group's samples share their source
            key = f"image.{path}"
            if key not in pixels:
                pixels[key] = _pixels(path)
            keys.append(key)
        return {"images": keys, "condition_key": [list(g) for g in self.model.condition_key(request)]}

    def _sample(self, request: GenRequest, tensors: dict[str, Any]) -> Sample:
        p = f"{request.uid}."
        layout, images = None, {}
        if p + "image_latents" in tensors:  # an edit: its image latents join both branches, at the engine's grids
            layout = tuple(tuple(int(v) for v in g) for g in tensors[p + "image_grids"].tolist())
            if layout != self.model.condition_key(request):
                raise UsageError(
                    f"The vllm-omni engine encoded the condition images of request {request.uid} at latent grids "
                    f"{layout}, the model at {self.model.condition_key(request)}: their resize rules differ.",
                    hint="Report it with the model's options (vae_image_area, vl_image_area).")
            images = {"image_latents": tensors[p + "image_latents"][None]}
        if p + "pooled_prompt_embeds" in tensors:  # FLUX.1 Kontext: T5 sequence (fixed length) + CLIP pooled
            cond = Conditioning({"prompt_embeds": tensors[p + "prompt_embeds"][None],
                                 "pooled_prompt_embeds": tensors[p + "pooled_prompt_embeds"][None], **images},
                                layout=layout)
        else:
            cond = Conditioning({"prompt_embeds": tensors[p + "prompt_embeds"][None],
                                 "prompt_mask": tensors[p + "prompt_mask"][None], **images},
                                pad_keys=("prompt_embeds", "prompt_mask"), layout=layout)
        uncond = None
        if p + "negative_pooled_prompt_embeds" in tensors:  # FLUX.1 Kontext's negative prompt (same source latents)
            uncond = Conditioning({"prompt_embeds": tensors[p + "negative_prompt_embeds"][None],
                                   "pooled_prompt_embeds": tensors[p + "negative_pooled_prompt_embeds"][None],
                                   **images}, layout=layout)
        elif p + "negative_prompt_embeds" in tensors:
            uncond = Conditioning({"prompt_embeds": tensors[p + "negative_prompt_embeds"][None],
                                   "prompt_mask": tensors[p + "negative_prompt_mask"][None], **images},
                                  pad_keys=("prompt_embeds", "prompt_mask"), layout=layout)
        logprobs = tensors[p + "logprobs"]
        if logprobs.numel() != request.plan.num_steps or math.isnan(float(tensors[p + "latents"].sum())):
            raise UsageError(f"The vllm-omni engine returned a malformed trajectory for request {request.uid}.")
        return Sample(request=request, latents=tensors[p + "latents"], sigmas=tensors[p + "sigmas"],
                      logprobs=logprobs, output=tensors[p + "image"], cond=cond, uncond=uncond)
