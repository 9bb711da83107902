"""The vllm-omni rollout server: ``python -m omnirl_plugin_vllm_omni.server --model DIR [--dtype float32]
[--max-num-seqs 32] [--pipeline OmnirlQwenImagePipeline]``, run by the engine in the vllm-omni environment (see
``engine.py``, which picks the pipeline class of ``pipeline.py`` for the model).

Calls (``omnirl_core.serving.rollout_server``): ``generate`` (requests with their rollout plans -> per request
the trajectory, sigmas, log-probs, prompt embeddings and image), ``load_lora`` (an adapter from tensors),
``load_weights`` (full denoiser weights, diffusers names), ``info``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any

from omnirl_core.serving.rollout_server import pack, serve, server_args, unpack

PIPELINES = "omnirl_plugin_vllm_omni.pipeline"
# vllm-omni picks its request pre- and post-processing by this name. The edit checkpoints' own (the source images
# from multi_modal_data, resized at fixed areas; the output a bare image tensor) do not fit omnirl's requests (the
# pixels in the plan, resized at the model's areas by the pipeline; an output envelope that carries the trajectory);
# Qwen-Image's pass the request through and keep the envelope's metadata.
REQUEST_HANDLING = "QwenImagePipeline"
WORKER_EXTENSION = "omnirl_plugin_vllm_omni.worker.OmnirlWorkerExtension"
ADAPTER_ID = 1  # one trained adapter, replaced at every sync


class RolloutServer:
    def __init__(self, model: str, dtype: str = "float32", max_num_seqs: int = 32,
                 pipeline: str = "OmnirlQwenImagePipeline"):
        self.model = model
        self.pipeline = pipeline
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.omni: Any = None
        self.lora: Any = None  # the LoRARequest every rollout request carries once an adapter is loaded
        self.lora_version = 0

    def start(self) -> None:
        from vllm_omni.entrypoints.omni import Omni

        self.omni = Omni(model=self.model, dtype=self.dtype, step_execution=True, max_num_seqs=self.max_num_seqs,
                         custom_pipeline_args={"pipeline_class": f"{PIPELINES}.{self.pipeline}"},
                         model_class_name=REQUEST_HANDLING, worker_extension_cls=WORKER_EXTENSION)

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        stage = self.omni.engine.collective_rpc(method=method, kwargs=kwargs, stage_ids=[0])[0]
        return stage[0] if isinstance(stage, list) else stage  # per worker: rank 0's answer

    def generate(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        # one generate call per (size, CFG scale, condition-image grids): those share one sampling-parameters object
        # and batch in one transformer call (condition tokens join the sequence); the plan of each request rides in
        # its prompt. vllm-omni steps each call's requests together (step execution).
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for r in meta["requests"]:
            layout = tuple(tuple(g) for g in r.get("condition_key") or ())
            groups.setdefault((r["height"], r["width"], r["guidance_scale"], layout), []).append(r)
        out: dict[str, Any] = {}
        start = time.perf_counter()
        embedded = meta.get("guidance") == "embedded"  # the scale is the transformer's input (FLUX.1), no CFG
        for (height, width, scale, _), rows in groups.items():
            cfg = scale > 1.0 and not embedded
            prompts = []
            for r in rows:
                plan = {k: r[k] for k in ("step_kinds", "eta", "sigmas", "latent_shape", "seed", "noise_seed", "uid")}
                plan["cfg_renorm"] = meta["cfg_renorm"]
                plan["guidance_scale"] = scale
                if "images" in r:  # an edit's sources: the pixels (H, W, 3) uint8, resized by the pipeline
                    plan["images"] = [tensors[key] for key in r["images"]]
                    plan["vae_image_area"] = meta["vae_image_area"]
                    plan["vl_image_area"] = meta["vl_image_area"]
                    plan["condition_key"] = r["condition_key"]  # the sources' latent grids (Kontext sizes by them)
                prompt = {"prompt": r["prompt"], "omnirl": plan}
                if scale > 1.0:  # the unconditional branch's prompt (embedded guidance: encoded for the sample only)
                    prompt["negative_prompt"] = meta["negative_prompt"]
                prompts.append(prompt)
            params = OmniDiffusionSamplingParams(
                height=height, width=width, num_inference_steps=len(rows[0]["step_kinds"]),
                true_cfg_scale=scale if cfg else 1.0, max_sequence_length=meta["max_sequence_length"],
                lora_request=self.lora)
            for output in self.omni.generate(prompts, params):
                rl = _rl_metadata(output)
                uid = int(rl["uid"])
                for name, value in rl.items():
                    if name != "uid":
                        out[f"{uid}.{name}"] = value
        seconds = time.perf_counter() - start
        return {"stats": {"seconds": seconds, "requests": len(meta["requests"]), "calls": len(groups)}}, out

    def load_lora(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        from vllm_omni.lora.request import LoRARequest

        self.lora_version += 1
        config = {"r": int(meta["rank"]), "lora_alpha": float(meta["alpha"])}
        loaded = self._rpc("omnirl_load_lora", adapter_id=ADAPTER_ID, peft_config=config, blob=pack({}, tensors))
        self.lora = LoRARequest(lora_name=f"omnirl-{self.lora_version}", lora_int_id=ADAPTER_ID,
                                lora_path=f"/omnirl/in-memory/{ADAPTER_ID}")
        return {"modules": loaded, "version": self.lora_version}, {}

    def load_weights(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        loaded = self._rpc("omnirl_load_weights", blob=pack({}, tensors))
        self.lora = None  # full weights replace whatever an adapter added
        self._rpc("omnirl_drop_lora", adapter_id=ADAPTER_ID)
        return {"loaded": loaded}, {}

    def weight(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, unpack(self._rpc("omnirl_weight", name=meta["name"]))[1]

    def info(self, meta: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        import vllm
        import vllm_omni

        return {"vllm": vllm.__version__, "vllm_omni": vllm_omni.__version__, "pid": os.getpid(),
                "lora_version": self.lora_version, "model": self.model, "pipeline": self.pipeline}, {}


def _rl_metadata(output: Any) -> dict[str, Any]:
    """The pipeline's ``metadata["rl"]`` group out of an OmniRequestOutput (where vllm-omni keeps it)."""
    for holder in (getattr(output, "multimodal_output", None), getattr(output, "custom_output", None)):
        if isinstance(holder, dict):
            metadata = holder.get("metadata") or {}
            if isinstance(metadata, dict) and "rl" in metadata:
                return metadata["rl"]
            if "rl" in holder:
                return holder["rl"]
    raise RuntimeError(f"vllm-omni returned no omnirl trajectory for request {getattr(output, 'request_id', '?')}; "
                       f"error: {getattr(output, 'error', None)}")


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to the server log (a hang's whereabouts)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = server_args()
    server = RolloutServer(args["model"], str(args.get("dtype", "float32")), int(args.get("max_num_seqs", 32)),
                           str(args.get("pipeline", "OmnirlQwenImagePipeline")))
    serve({"generate": server.generate, "load_lora": server.load_lora, "load_weights": server.load_weights,
           "weight": server.weight, "info": server.info}, setup=server.start)


if __name__ == "__main__":
    main()
