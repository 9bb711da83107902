"""The trainer-side half of the vllm-omni rollout engine: no vllm import here.

The engine runs vllm-omni in a server process of its own, in the environment ``omnirl env build vllm-omni``
builds (``omnirl_core.runtime.envs``), and talks to it over 127.0.0.1 (``omnirl_core.runtime.rollout_server``:
safetensors + JSON, no pickle). This side turns ``GenRequest``s into requests that carry the rollout plan
(sampler kind per step, eta, the model's sigmas for the plan, seeds), and the server's results back into
``Sample``s with the trajectory, log-probs, the engine's prompt embeddings (what the trainer re-evaluates
with) and the image.

Weight sync: before a rollout, when the trained weights changed since the last push (torch's in-place
version counters of the trainable parameters), they go to the engine: the LoRA tensors through vllm-omni's
adapter API (loaded from tensors, no files), or the full denoiser (``weight_sync: full``; with LoRA the
adapter merged into the base weights).

One server per (environment, model directory, engine arguments) per process, shared by every engine object
that asks for the same: tests and repeated runs in one process start vllm-omni once.
"""

from __future__ import annotations

import atexit
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.errors import UsageError
from omnirl_core.interfaces import Conditioning, GenRequest, Sample
from omnirl_core.runtime.envs import component_environment, environment_python
from omnirl_core.runtime.rollout_server import ServerProcess

SERVER_MODULE = "omnirl_plugin_vllm_omni.server"


class VllmOmniRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_seqs: int = Field(32, ge=1, description="Most requests vllm-omni steps together (its step-wise batching).")
    weight_sync: Literal["auto", "full", "none"] = Field(
        "auto", description="How trained weights reach the engine before a rollout: 'auto' (the LoRA adapter "
        "from tensors when training LoRA, else the full denoiser), 'full' (always the full denoiser; a LoRA "
        "merged into it), 'none' (never: the engine keeps the weights it started with)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where vllm-omni runs: 'auto' follows the trainer's device; 'cpu' uses omnirl's CPU "
        "platform for vllm-omni (tests, no GPU)."
    )
    start_timeout_s: float = Field(900.0, gt=0, description="Longest wait for the engine to start.")
    request_timeout_s: float = Field(3600.0, gt=0, description="Longest wait for one rollout call.")


_SERVERS: dict[tuple, ServerProcess] = {}
_LOCK = threading.Lock()


def shared_server(python: Path, args: list[str], env: dict[str, str], start_timeout_s: float) -> ServerProcess:
    key = (str(python), tuple(args), tuple(sorted(env.items())))
    with _LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            server = ServerProcess(python, SERVER_MODULE, args, env=env, start_timeout_s=start_timeout_s,
                                   name="vllm-omni rollout server")
            _SERVERS[key] = server
        return server


@atexit.register
def close_servers() -> None:
    with _LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


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


class VllmOmniRolloutEngine:
    def __init__(self, model: Any, options: VllmOmniRolloutOptions | None, device: Any):
        self.model = model
        self.options = options or VllmOmniRolloutOptions()
        kind = getattr(device, "type", str(device)).split(":")[0]
        self.device_kind = kind if self.options.device == "auto" else self.options.device
        if self.device_kind not in ("cpu", "cuda"):
            raise UsageError(f"The vllm-omni engine runs on cpu or cuda, not '{self.device_kind}'.",
                             hint="Use rollout.engine=diffusers on this device.")
        self.directory = model_directory(model)
        env = component_environment("vllm-omni", self.device_kind)
        self.python = environment_python(env)
        self.env_vars = dict(env.env)
        if self.device_kind == "cpu":
            self.env_vars["OMNIRL_VLLM_OMNI_CPU"] = "1"
        dtype = str(getattr(model, "dtype", "float32")).replace("torch.", "")
        self.args = ["--model", self.directory, "--dtype", dtype, "--max-num-seqs", str(self.options.max_num_seqs)]
        self._server: ServerProcess | None = None
        self._sigmas: dict[tuple, Any] = {}
        self._synced_version = self._weights_version()  # the engine starts with the weights on disk
        self.sync_seconds = 0.0
        self.syncs = 0

    # -- server --------------------------------------------------------------------------------
    @property
    def server(self) -> ServerProcess:
        if self._server is None or self._server.proc.poll() is not None:
            self._server = shared_server(self.python, self.args, self.env_vars, self.options.start_timeout_s)
            self._synced_version = None if self._pushed_any else self._synced_version
        return self._server

    _pushed_any = False

    # -- weight sync ---------------------------------------------------------------------------
    def _weights_version(self) -> tuple[int, ...]:
        params = self.model.trainable_parameters() if hasattr(self.model, "trainable_parameters") else []
        return tuple(p._version for p in params)

    def sync_weights(self, force: bool = False) -> dict[str, float]:
        """Push the trained weights to the engine if they changed since the last push (or ``force``)."""
        if self.options.weight_sync == "none":
            return {}
        version = self._weights_version()
        if not force and version == self._synced_version:
            return {}
        start = time.perf_counter()
        lora = getattr(self.model, "lora", None)
        if lora is not None and self.options.weight_sync == "auto":
            from peft.utils import get_peft_model_state_dict

            state = get_peft_model_state_dict(self.model.denoiser)
            meta = {"rank": lora.rank, "alpha": lora.alpha}  # the worker names the target modules
            self.server.call("load_lora", meta, state, timeout_s=self.options.request_timeout_s)
        else:
            state = self._full_state()
            self.server.call("load_weights", {}, state, timeout_s=self.options.request_timeout_s)
        self._synced_version = version
        self._pushed_any = True
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        self.syncs += 1
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"sync/seconds": seconds, "sync/mib": nbytes / 2**20}

    def _full_state(self) -> dict[str, Any]:
        """The denoiser's weights in diffusers names; a LoRA adapter merged in (base + scale B A)."""
        import torch

        denoiser = self.model.denoiser
        if getattr(self.model, "lora", None) is None:
            return {k: v.detach() for k, v in denoiser.state_dict().items()}
        out = {}
        with torch.no_grad():
            for name, module in denoiser.named_modules():
                base = getattr(module, "base_layer", None)
                if base is not None and hasattr(module, "get_delta_weight"):
                    weight = base.weight.detach().clone()
                    for adapter in getattr(module, "active_adapters", []):
                        weight += module.get_delta_weight(adapter).to(weight.dtype)
                    out[f"{name}.weight"] = weight
                    if getattr(base, "bias", None) is not None:
                        out[f"{name}.bias"] = base.bias.detach()
            for key, value in denoiser.state_dict().items():
                if "lora_" in key or ".base_layer." in key:
                    continue
                out.setdefault(key, value.detach())
        return out

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
            "max_sequence_length": int(getattr(options, "max_sequence_length", 512)),
        }
        fields = []
        for r in requests:
            shape = tuple(self.model.latent_shape(r.height, r.width, r.num_frames))
            fields.append(_plan_fields(r, self._schedule(r, shape).tolist(), shape))
        meta, tensors = self.server.call("generate", {"requests": fields, **common},
                                         timeout_s=self.options.request_timeout_s)
        self.last_stats = meta.get("stats", {})
        for r in requests:
            yield self._sample(r, tensors)

    def _sample(self, request: GenRequest, tensors: dict[str, Any]) -> Sample:
        p = f"{request.uid}."
        cond = Conditioning({"prompt_embeds": tensors[p + "prompt_embeds"][None],
                             "prompt_mask": tensors[p + "prompt_mask"][None]},
                            pad_keys=("prompt_embeds", "prompt_mask"))
        uncond = None
        if p + "negative_prompt_embeds" in tensors:
            uncond = Conditioning({"prompt_embeds": tensors[p + "negative_prompt_embeds"][None],
                                   "prompt_mask": tensors[p + "negative_prompt_mask"][None]},
                                  pad_keys=("prompt_embeds", "prompt_mask"))
        logprobs = tensors[p + "logprobs"]
        if logprobs.numel() != request.plan.num_steps or math.isnan(float(tensors[p + "latents"].sum())):
            raise UsageError(f"The vllm-omni engine returned a malformed trajectory for request {request.uid}.")
        return Sample(request=request, latents=tensors[p + "latents"], sigmas=tensors[p + "sigmas"],
                      logprobs=logprobs, output=tensors[p + "image"], extras={"cond": cond, "uncond": uncond})

    def close(self) -> None:
        """Nothing to do: the shared server lives until the process exits (``close_servers``)."""
