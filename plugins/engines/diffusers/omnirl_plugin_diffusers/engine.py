"""The embedded rollout engine: denoising over the flow-model contract with the core sampler.

Requests enter a queue (``generate`` or, from any thread, ``submit``) and become eligible at their arrival
time. Each iteration the scheduler (``scheduler.py``) admits arrived requests and picks one batch of
requests that can share a ``velocity`` call (same latent shape and CFG scale); the engine makes that call,
applies the sampler to every request at its own step and sigma, and decodes and yields the requests that
finished, at once. Modes: ``step`` (step-wise continuous batching, the default), ``request`` (static
batches) and ``single`` (one request at a time).

Batch invariance: every request draws its initial latent and its step noise from its own seeded
generators, and its conditioning does not depend on which prompts it was encoded with, so a sample's
latents and log-probs do not depend on what shared its batches (up to float rounding of the batched call).

Model calls (text encoding, velocity, VAE decode) run through ``interruptible``: a stop signal ends a rollout within
a second even inside one long call (a 2048x2048 decode on a CPU is minutes of one native call), and a rollout that
takes long says how far it is (``_Progress``: denoising steps done, an estimate of what is left).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Conditioning, GenRequest, RolloutEngine, Sample
from omnirl_core.errors import UsageError
from omnirl_core.flow.embedding_cache import EmbeddingCache
from omnirl_core.flow.sampler import sample_step
from omnirl_core.loop.interrupts import interruptible
from omnirl_plugin_diffusers.scheduler import Batch, Scheduler, Slot, StaticScheduler, StepScheduler
from omnirl_plugin_diffusers.stats import RolloutStats

log = logging.getLogger("omnirl")

_FP32_BYTES = 4
PROGRESS_AFTER_S = 15.0
"""A rollout that has run this long reports its progress (and again at most this often)."""
AUTO_DECODE_BATCH = 8
"""``decode_batch: auto``'s batch while requests queue (the static modes decode up to ``max_num_seqs`` at once)."""


class DiffusersRolloutOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["step", "request", "single"] = Field(
        "step", description="Batching: 'step' (step-wise continuous batching), 'request' (static batches that "
        "run until their longest request is done), 'single' (one request at a time)."
    )
    max_num_seqs: int = Field(32, ge=1, description="Most requests in one model call.")
    max_latent_mib: float | None = Field(
        None, gt=0, description="Cap on the fp32 latents of the requests in flight, in MiB (None: no cap). "
        "Requests wait in the queue until they fit."
    )
    embedding_cache_size: int = Field(
        1024, ge=0, description="Prompts whose conditioning is kept while the text encoder is unchanged "
        "(0: no cache, every request encodes its own prompt)."
    )
    decode_batch: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Step-wise: finished requests are decoded once this many have finished (or nothing "
        "else runs), in fewer, larger VAE calls. 1: each sample is decoded and handed out right after its last "
        "step (what async rewards want). 'auto': 1 while no request waits for a slot (an RL wave that fits), "
        f"{AUTO_DECODE_BATCH} while arrived requests queue behind the running ones (a serving load, where the "
        "engine is throughput-bound and a held sample waits a few steps against a queue's seconds)."
    )


def _queued(scheduler: Scheduler) -> bool:
    """Whether a request that has arrived waits for a slot (the waiting list is in arrival order)."""
    return bool(scheduler.waiting) and scheduler.waiting[0].arrival <= time.perf_counter()


def _request_noise(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


@dataclass(eq=False)
class _Trajectory:
    """The tensors of one request in flight."""

    x: torch.Tensor  # current latent, on the device
    sigmas: torch.Tensor  # (T + 1,) fp32, on the host
    states: list[torch.Tensor]  # x_0 .. x_step on the host
    logprobs: torch.Tensor  # (T,) NaN for ODE steps
    noise: torch.Generator  # the request's own step noise
    cond: Conditioning
    uncond: Conditioning | None
    history: tuple[torch.Tensor, torch.Tensor] | None = None  # last step's (x0 prediction, sigma): dpm2


class _Progress:
    """How far one ``generate`` call is, said when it takes long: denoising steps (one request advanced by one
    step) done of those queued, and an estimate of the time left at the rate so far. Silent for a rollout shorter
    than ``PROGRESS_AFTER_S``."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.total = self.done = self.samples = self.finished = 0

    def add(self, num_steps: int) -> None:
        self.total += num_steps
        self.samples += 1

    def step(self, rows: int) -> None:
        self.done += rows
        self.report()

    def decoded(self, count: int) -> None:
        self.finished += count
        self.report()

    def report(self, running: str = "") -> None:
        now = time.perf_counter()
        if now - self.start < PROGRESS_AFTER_S or now - self.last < PROGRESS_AFTER_S:
            return
        self.last = now
        elapsed = now - self.start
        left = (f"; about {_duration(elapsed * (self.total - self.done) / self.done)} of denoising left (estimate)"
                if 0 < self.done < self.total else "")
        log.info("rollout: %d of %d denoising steps done (%d requests, %d of them finished) in %s%s%s",
                 self.done, self.total, self.samples, self.finished, _duration(elapsed), left,
                 f"; {running}" if running else "")

    def waiting(self, what: str) -> Any:
        """A heartbeat for ``interruptible``: progress while one long call runs."""
        return lambda seconds: self.report(f"{what}, running for {_duration(seconds)}")

    heartbeat_s = 5.0
    """How often a long call's wait looks at the clock (``report`` says something at most every
    ``PROGRESS_AFTER_S``)."""


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _no_grad(fn: Any, device: torch.device) -> Any:
    """``fn`` as the engine's thread would run it: without autograd, on the engine's CUDA device (both are the
    calling thread's own state, which a helper thread does not share)."""
    def call() -> Any:
        with torch.no_grad():
            if device.type == "cuda":
                with torch.cuda.device(device):
                    return fn()
            return fn()
    return call


class DiffusersRolloutEngine(RolloutEngine):
    def __init__(self, model: Any, options: DiffusersRolloutOptions | None, device: Any):
        self.model = model
        self.options = options or DiffusersRolloutOptions()
        self.device = torch.device(device)
        self.embeddings = EmbeddingCache(model, self.options.embedding_cache_size)
        self.stats = RolloutStats(self.options.mode, self._max_num_seqs())
        self.progress = _Progress()
        self._inbox: list[tuple[GenRequest, float]] = []
        self._wakeup = threading.Condition()
        self._sigmas: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self._batch_cond: dict[Hashable, tuple[tuple[int, ...], Conditioning, Conditioning | None]] = {}

    # -- queue ---------------------------------------------------------------------------------
    def submit(self, request: GenRequest) -> None:
        """Queue a request from any thread; it arrives ``request.arrival_s`` seconds from now and is
        returned by the ``generate`` call that is running (or by the next one)."""
        with self._wakeup:
            self._inbox.append((request, time.perf_counter() + request.arrival_s))
            self._wakeup.notify()

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        """Generate ``requests`` (each arriving ``arrival_s`` after the call) and any request submitted
        meanwhile; yields every sample as soon as it is finished, in completion order."""
        start = time.perf_counter()
        with self._wakeup:
            self._inbox.extend((r, start + r.arrival_s) for r in requests)
        self.stats = RolloutStats(self.options.mode, self._max_num_seqs(), started=start)
        self.progress = _Progress()
        encode_before = self.embeddings.stats.as_dict()
        try:
            yield from self._serve(self._new_scheduler())
        finally:
            self.stats.ended = time.perf_counter()
            after = self.embeddings.stats.as_dict()
            self.stats.encode = {k: after[k] - encode_before[k] for k in after}
            self._batch_cond.clear()

    def _max_num_seqs(self) -> int:
        return 1 if self.options.mode == "single" else self.options.max_num_seqs

    def _new_scheduler(self) -> Scheduler:
        cap = self.options.max_latent_mib
        max_bytes = None if cap is None else int(cap * 2**20)
        if self.options.mode == "step":
            return StepScheduler(self._max_num_seqs(), max_bytes)
        return StaticScheduler(self._max_num_seqs(), max_bytes)

    # -- loop ----------------------------------------------------------------------------------
    def _serve(self, scheduler: Scheduler) -> Iterator[Sample]:
        stats = self.stats
        held: list[Slot] = []  # finished, waiting to be decoded with others (decode_batch)
        fixed = self.options.decode_batch if self.options.mode == "step" else 1
        while True:
            self._drain_inbox(scheduler)
            if scheduler.idle:
                yield from self._retire(held)
                return
            now = time.perf_counter()
            admitted = scheduler.admit(now)
            if admitted:
                self._activate(admitted)
                stats.seconds["admit"] += time.perf_counter() - now
                stats.max_active = max(stats.max_active, len(scheduler.active))
            batch = scheduler.next_batch()
            if batch is None:
                self._wait(scheduler.next_arrival(now))
                continue
            self._run(batch)
            if not scheduler.waiting:
                stats.drain_calls += 1
                stats.drain_useful_rows += len(batch.rows)
            held += scheduler.finish(batch)
            hold = fixed if fixed != "auto" else AUTO_DECODE_BATCH if _queued(scheduler) else 1
            if held and (len(held) >= hold or not scheduler.active):
                yield from self._retire(held)
                held = []

    def _drain_inbox(self, scheduler: Scheduler) -> None:
        with self._wakeup:
            pending, self._inbox = self._inbox, []
        for request, arrival in pending:
            shape = tuple(self.model.latent_shape(request.height, request.width, request.num_frames))
            # requests share a call only with the same latent shape, guidance and condition-token shapes (an edit's
            # source images of one size): condition latents are concatenated to the sequence, never padded
            key = (shape, float(request.guidance_scale), self.model.condition_key(request))
            slot = Slot(request=request, key=key,
                        nbytes=math.prod(shape) * _FP32_BYTES, num_steps=request.plan.num_steps, arrival=arrival)
            self.progress.add(request.plan.num_steps)
            try:
                scheduler.add(slot)
            except ValueError as exc:
                raise UsageError(
                    f"Request {request.uid} ({request.width}x{request.height}) needs "
                    f"{slot.nbytes / 2**20:.3g} MiB of latents, more than rollout.options.max_latent_mib = "
                    f"{self.options.max_latent_mib}.",
                    hint="Raise rollout.options.max_latent_mib (or unset it), or lower the resolution.",
                ) from exc

    def _wait(self, until: float | None) -> None:
        """Sleep until the next arrival or a ``submit``."""
        start = time.perf_counter()
        with self._wakeup:
            if not self._inbox:
                self._wakeup.wait(None if until is None else max(until - start, 0.0))
        self.stats.seconds["idle"] += time.perf_counter() - start

    # -- tensors -------------------------------------------------------------------------------
    def _schedule(self, num_steps: int, shape: tuple[int, ...]) -> torch.Tensor:
        key = (num_steps, shape)
        if key not in self._sigmas:
            self._sigmas[key] = self.model.sigmas(num_steps, shape).to(torch.float32).cpu()
        return self._sigmas[key]

    def _negative(self) -> Conditioning:
        return self.embeddings.lookup([getattr(self.model, "negative_prompt", " ")])[0]

    def _activate(self, slots: list[Slot]) -> None:
        """Conditioning (one text-encoder call for the prompts not cached) and the initial latents."""
        if self.model.condition_images > 0:
            conds, unconds = interruptible(_no_grad(lambda: self._encode_with_images(slots), self.device),
                                           self.progress.waiting("encoding prompts and condition images"),
                                           self.progress.heartbeat_s)
        else:
            def encode() -> tuple[list[Conditioning], Conditioning | None]:
                conds = self.embeddings.lookup([s.request.prompt for s in slots])
                return conds, self._negative() if any(s.request.guidance_scale > 1.0 for s in slots) else None

            conds, uncond = interruptible(_no_grad(encode, self.device), self.progress.waiting("encoding prompts"),
                                          self.progress.heartbeat_s)
            unconds = [uncond] * len(slots)
        for slot, cond, uncond in zip(slots, conds, unconds):
            r = slot.request
            shape = slot.key[0]
            x = _request_noise(r.noise_seed if r.noise_seed is not None else r.seed, shape)
            slot.state = _Trajectory(
                x=x.to(self.device), sigmas=r.plan.sigmas_from(self._schedule(r.plan.schedule_steps, shape)),
                states=[x],
                logprobs=torch.full((r.plan.num_steps,), float("nan")),
                noise=torch.Generator().manual_seed(r.seed + 1),
                cond=cond, uncond=uncond if r.guidance_scale > 1.0 else None,
            )

    def _encode_with_images(self, slots: list[Slot]) -> tuple[list[Conditioning], list[Conditioning | None]]:
        """An image-conditioned model's conditioning: per (prompt, condition images), shared by a group's samples
        (the images' latents encoded once per group), and with CFG the negative prompt with the same images."""
        images = [s.request.condition_images for s in slots]
        conds = self.embeddings.lookup([s.request.prompt for s in slots], images)
        guided = [j for j, s in enumerate(slots) if s.request.guidance_scale > 1.0]
        unconds: list[Conditioning | None] = [None] * len(slots)
        if guided:
            negative = getattr(self.model, "negative_prompt", " ")
            for j, row in zip(guided, self.embeddings.lookup([negative] * len(guided), [images[j] for j in guided])):
                unconds[j] = row
        return conds, unconds

    def _conditioning(self, batch: Batch) -> tuple[Conditioning, Conditioning | None]:
        """The batch's concatenated conditioning, reused while the bucket's members are unchanged."""
        ids = tuple(s.order for s in batch.slots)
        cached = self._batch_cond.get(batch.key)
        if cached is None or cached[0] != ids:
            trajs = [s.state for s in batch.slots]
            cond = Conditioning.cat([t.cond for t in trajs]).to(self.device)
            uncond = None
            if trajs[0].uncond is not None:
                uncond = Conditioning.cat([t.uncond for t in trajs]).to(self.device)
            cached = (ids, cond, uncond)
            self._batch_cond[batch.key] = cached
        return cached[1], cached[2]

    @torch.no_grad()
    def _run(self, batch: Batch) -> None:
        """One model call for the batch, then one sampler step per request (grouped by sampler kind)."""
        stats = self.stats
        t0 = time.perf_counter()
        slots = batch.slots
        x = torch.stack([s.state.x for s in slots])
        # a padding row sits at its final sigma; its output is thrown away
        s_now = torch.stack([s.state.sigmas[min(s.step, s.num_steps)] for s in slots]).to(self.device)
        cond, uncond = self._conditioning(batch)
        scale = float(batch.key[1])
        step = f"{min(s.step for s in batch.rows) + 1} of {batch.rows[0].num_steps}"
        v = interruptible(_no_grad(lambda: self.model.velocity(x, s_now, cond, scale, uncond), self.device),
                          self.progress.waiting(f"denoising step {step} for {len(batch.rows)} request(s)"),
                          self.progress.heartbeat_s)
        t1 = time.perf_counter()
        groups: dict[tuple[str, float], list[int]] = {}
        for j, s in enumerate(batch.rows):
            plan = s.request.plan
            groups.setdefault((plan.step_kinds[s.step], plan.eta), []).append(j)
        for (kind, eta), rows in groups.items():
            members = [batch.rows[j] for j in rows]
            index = torch.as_tensor(rows, device=self.device)
            s_next = torch.stack([m.state.sigmas[m.step + 1] for m in members]).to(self.device)
            sigma_max = torch.stack([m.state.sigmas[1] for m in members]).to(self.device)
            noise = None
            if kind != "ode":
                shape = x.shape[1:]
                noise = torch.stack([torch.randn(shape, generator=m.state.noise) for m in members]).to(self.device)
            history = None
            if kind == "dpm2":  # multistep: each request's previous data prediction (none: first order)
                none = (torch.zeros_like(x[0]), torch.ones((), device=self.device))
                past = [m.state.history or none for m in members]
                history = (torch.stack([h[0] for h in past]), torch.stack([h[1] for h in past]))
            out = sample_step(kind, x[index], v[index], s_now[index], s_next, eta, noise, sigma_max, history)
            host = out.prev_sample.cpu()
            logprob = out.logprob.cpu() if out.logprob is not None else None
            for k, m in enumerate(members):
                m.state.x = out.prev_sample[k]
                m.state.history = (out.x0[k], s_now[index][k])
                m.state.states.append(host[k])
                if logprob is not None:
                    m.state.logprobs[m.step] = logprob[k]
                m.step += 1
        t2 = time.perf_counter()
        stats.seconds["velocity"] += t1 - t0
        stats.seconds["sampler"] += t2 - t1
        row_cost = float(x[0].numel() * (2 if scale > 1.0 else 1))
        stats.model_calls += 1
        stats.useful_rows += len(batch.rows)
        stats.padding_rows += len(batch.padding)
        stats.useful_cost += row_cost * len(batch.rows)
        stats.padding_cost += row_cost * len(batch.padding)
        self.progress.step(len(batch.rows))

    def _retire(self, slots: list[Slot]) -> Iterator[Sample]:
        """Decode finished requests (one VAE call per latent shape) and hand them out."""
        buckets: dict[Hashable, list[Slot]] = {}
        for s in slots:
            buckets.setdefault(s.key[0], []).append(s)  # the key's shape: guidance does not change decoding
        for group in buckets.values():
            t0 = time.perf_counter()
            latents = torch.stack([s.state.x for s in group])
            images = interruptible(_no_grad(functools.partial(self.model.decode, latents), self.device),
                                   self.progress.waiting(f"decoding {len(group)} sample(s)"), self.progress.heartbeat_s)
            finished = time.perf_counter()
            self.progress.decoded(len(group))
            self.stats.seconds["decode"] += finished - t0
            self.stats.decode_calls += 1
            for s, image in zip(group, images):
                t = s.state
                self.stats.latencies.append(finished - s.arrival)
                self.stats.samples += 1
                s.state = None  # the latents leave the engine with the sample
                # image.clone(): a row of the batch's decode would keep (and pickle, e.g. to a Ray actor) the
                # whole batch's storage
                yield Sample(request=s.request, latents=torch.stack(t.states), sigmas=t.sigmas.clone(),
                             logprobs=t.logprobs, output=image.clone(),
                             cond=t.cond, uncond=t.uncond)
