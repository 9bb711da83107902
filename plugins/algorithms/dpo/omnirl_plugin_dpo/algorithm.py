"""Diffusion-DPO for flow matching over the model contract: no log-probs, any sampler for the rollout.

Pairs: online, the best- and worst-reward samples of each prompt's group (``pairs_per_group`` > 1 pairs the
i-th best with the i-th worst); offline, (prompt, chosen image, rejected image) records of a preference
file, the images encoded to latents by the model (``encode_images``). Each pair gets one noise eps and one
level s, shared by winner and loser: x_s = (1 - s) x0 + s eps, target u = eps - x0, and
  e(x0) = mean over dims ||v(x_s, s) - u||^2, for the policy and for the frozen reference;
  Delta = [e_theta(w) - e_ref(w)] - [e_theta(l) - e_ref(l)];  loss = -log sigmoid(-(beta / 2) Delta).
At Delta = 0 (policy = reference) the loss is log 2. The reference is the base model, or (online option) a
snapshot of the policy refreshed every ``ref_update_every`` steps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.algorithm import Algorithm
from omnirl_core.config import RunConfig
from omnirl_core.contracts import Conditioning, RolloutPlan, Sample, TrainingUnit
from omnirl_core.errors import ConfigError, UsageError
from omnirl_core.flow.batching import grouped_velocity
from omnirl_core.flow.sampler import mean_over_dims, noised, training_sigmas, velocity_target
from omnirl_core.rl.ema import ShadowParameters


class DPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["online", "offline"] = Field(
        "online", description="'online': pairs from each step's rollout (best vs worst of a group); 'offline': "
        "pairs from preference_file (the rollout then only measures the reward)."
    )
    beta: float = Field(2000.0, gt=0, description="DPO beta (2000 default; 100 in flow-matching recipes).")
    pairs_per_group: int = Field(1, ge=1, description="Online: pairs per group, i-th best vs i-th worst.")
    noise_draws: int = Field(1, ge=1, description="Independent (eps, s) draws per pair per step.")
    sigma_sampling: Literal["uniform", "logit-normal"] = Field(
        "uniform", description="Distribution of the training noise level s."
    )
    logit_mean: float = Field(0.0, description="Logit-normal s: mean of the normal.")
    logit_std: float = Field(1.0, gt=0, description="Logit-normal s: std of the normal.")
    sigma_min: float = Field(0.0, ge=0, lt=1, description="Smallest training s.")
    sigma_max: float = Field(1.0, gt=0, le=1, description="Largest training s.")
    ref_update_every: int | None = Field(
        None, ge=1, description="Online reference: a snapshot of the policy refreshed every N steps (about 40 in "
        "the reference project); None keeps the base model."
    )
    sampler: Literal["ode", "sde", "dance"] = Field("ode", description="Rollout sampler (no log-probs are used).")
    noise_level: float = Field(0.7, gt=0, description="eta of a stochastic rollout sampler.")
    preference_file: str | None = Field(
        None, description="Offline: a .jsonl file of {\"prompt\", \"chosen\", \"rejected\"} records; image paths "
        "relative to the file."
    )
    pairs_per_step: int = Field(16, ge=1, description="Offline: preference records drawn per training step.")


@dataclass
class PreferencePair(TrainingUnit):
    """One (eps, s) draw of a preference pair. Online pairs carry latents; offline pairs carry image paths
    until ``prepare`` encodes them."""

    sample: ClassVar[None] = None  # a unit of no single sample

    prompt: str
    step: int
    eps: torch.Tensor
    sigma: torch.Tensor  # () fp32
    chosen: torch.Tensor | None = None  # x0 latents
    rejected: torch.Tensor | None = None
    cond: Conditioning | None = None
    chosen_path: str | None = None
    rejected_path: str | None = None
    ref_error: torch.Tensor | None = None  # (2,) e_ref(w), e_ref(l)
    reward_gap: float = float("nan")
    extras: dict[str, Any] = field(default_factory=dict)


def dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: (-log sigmoid(-(beta / 2) Delta), Delta)."""
    delta = (err_w - ref_w) - (err_l - ref_l)
    return -F.logsigmoid(-0.5 * beta * delta), delta


def load_preferences(path: str) -> list[dict[str, str]]:
    """Records of a preference file, with image paths made absolute and checked; clear errors otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"Preference file '{path}' not found (algorithm.options.preference_file).",
                          hint="Give a .jsonl file with one {\"prompt\", \"chosen\", \"rejected\"} record per line.")
    records = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            item = {k: str(rec[k]) for k in ("prompt", "chosen", "rejected")}
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{file}:{n}: expected a JSON object with 'prompt', 'chosen' and 'rejected'.",
                              hint="Image paths may be relative to the preference file.") from exc
        for key in ("chosen", "rejected"):
            image = Path(item[key]) if Path(item[key]).is_absolute() else file.parent / item[key]
            if not image.is_file():
                raise ConfigError(f"{file}:{n}: {key} image '{item[key]}' not found.",
                                  hint="Paths are read relative to the preference file's directory.")
            item[key] = str(image)
        records.append(item)
    if not records:
        raise ConfigError(f"Preference file '{path}' holds no records.")
    return records


def load_image(path: str, height: int, width: int) -> torch.Tensor:
    """(3, H, W) in [0, 1], resized to the rollout resolution."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        rgb = img.convert("RGB").resize((width, height), Image.BICUBIC)
        arr = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class DiffusionDPO(Algorithm):
    reference_fields = ("ref_error",)

    def __init__(self, options: DPOConfig | None, config: RunConfig):
        super().__init__(options or DPOConfig(), config)
        o = self.options
        self.uses_reference = o.ref_update_every is None
        self.snapshot: ShadowParameters | None = None
        self._snapshot_step = 0
        self._step = 0
        self._latents: dict[str, torch.Tensor] = {}
        self._conds: dict[str, Conditioning] = {}
        if o.sigma_min >= o.sigma_max:
            raise ConfigError(f"DPO sigma_min {o.sigma_min} must be below sigma_max {o.sigma_max}.")
        self.records: list[dict[str, str]] = []
        if o.mode == "offline":
            if o.preference_file is None:
                raise ConfigError("DPO offline mode needs a preference file.",
                                  hint="Set algorithm.options.preference_file=PATH.jsonl")
            self.records = load_preferences(o.preference_file)
        kinds = (o.sampler,) * config.rollout.num_steps
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=(), eta=o.noise_level)

    # -- rollout -------------------------------------------------------------------------------
    def plan(self, step: int) -> RolloutPlan:
        self._step = step  # the controller calls plan(step) before training_units of that step
        return self._plan

    def assign_advantages(self, samples: list[Sample]) -> dict[str, float]:
        return {}  # DPO uses the ranking within a group, not advantages

    # -- pairs ---------------------------------------------------------------------------------
    def _draws(self, seed: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        o = self.options
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(o.noise_draws):
            eps = torch.randn(like.shape, generator=gen, dtype=torch.float32)
            s = training_sigmas(1, gen, o.sigma_sampling, o.sigma_min, o.sigma_max, o.logit_mean, o.logit_std)[0]
            out.append((eps, s))
        return out

    def training_units(self, samples: list[Sample]) -> list[PreferencePair]:
        if self.options.mode == "offline":
            return self._offline_pairs()
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.request.group, []).append(s)
        units = []
        for members in groups.values():
            ranked = sorted(members, key=lambda s: (-s.reward, s.request.uid))
            for i in range(min(self.options.pairs_per_group, len(ranked) // 2)):
                win, lose = ranked[i], ranked[-1 - i]
                x_w, x_l = win.latents[-1].float(), lose.latents[-1].float()
                for eps, s in self._draws(win.request.seed ^ lose.request.seed, x_w):
                    units.append(PreferencePair(prompt=win.prompt, step=self._step, eps=eps, sigma=s, chosen=x_w,
                                                rejected=x_l, cond=win.cond,
                                                reward_gap=win.reward - lose.reward))
        return units

    def _offline_pairs(self) -> list[PreferencePair]:
        o = self.options
        rng = random.Random(self.config.run.seed * 1_000_003 + self._step)
        count = o.pairs_per_step
        picks = rng.sample(range(len(self.records)), count) if count <= len(self.records) else \
            [rng.randrange(len(self.records)) for _ in range(count)]
        units = []
        for index in picks:
            rec = self.records[index]
            like = torch.empty(0)  # shapes are known only after encoding; eps is drawn in prepare
            seed = (self.config.run.seed * 1_000_003 + self._step) * 100_003 + index
            units.append(PreferencePair(prompt=rec["prompt"], step=self._step, eps=like,
                                        sigma=torch.tensor(float("nan")), chosen_path=rec["chosen"],
                                        rejected_path=rec["rejected"], extras={"seed": seed}))
        return units

    # -- update --------------------------------------------------------------------------------
    def _encode_offline(self, model: Any, units: list[PreferencePair]) -> None:
        if not model.encodes_images:
            raise UsageError(
                f"DPO offline mode needs a model that encodes images to latents; {type(model).__name__} has no "
                "encode_images.",
                hint="Use a model plugin with the encode_images capability, or algorithm.options.mode=online.",
            )
        if model.condition_images > 0:
            raise UsageError(
                f"DPO offline mode does not give {type(model).__name__} the source images it edits: preference "
                "records carry a prompt and two images, no source.",
                hint="Train an editing model with algorithm.options.mode=online (pairs from one source's group).",
            )
        height, width = self.config.rollout.height, self.config.rollout.width
        missing = sorted({p for u in units for p in (u.chosen_path, u.rejected_path)} - set(self._latents))
        if missing:
            images = torch.stack([load_image(p, height, width) for p in missing])
            latents = model.encode_images(images).float().cpu()
            self._latents.update(zip(missing, latents))
        prompts = sorted({u.prompt for u in units} - set(self._conds))
        if prompts:
            cond = model.encode(prompts)
            self._conds.update((p, cond.select([i])) for i, p in enumerate(prompts))
        o = self.options
        for u in units:
            u.chosen, u.rejected, u.cond = self._latents[u.chosen_path], self._latents[u.rejected_path], \
                self._conds[u.prompt]
            gen = torch.Generator().manual_seed(u.extras["seed"])
            u.eps = torch.randn(u.chosen.shape, generator=gen, dtype=torch.float32)
            u.sigma = training_sigmas(1, gen, o.sigma_sampling, o.sigma_min, o.sigma_max, o.logit_mean,
                                      o.logit_std)[0]

    def reference_prepare(self, model: Any, units: list[PreferencePair]) -> None:
        """Without grad, ``model`` being the reference (base) policy: its errors on winners and losers
        (offline pairs are encoded first: a reference worker encodes its own copy)."""
        if units[0].chosen is None:
            self._encode_offline(model, units)
        self._store_reference_errors(model, units)

    def _store_reference_errors(self, model: Any, units: list[PreferencePair]) -> None:
        ref_w, ref_l = self._errors(model, units)
        for u, a, b in zip(units, ref_w, ref_l):
            u.ref_error = torch.stack([a, b]).detach()

    def _errors(self, model: Any, units: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        """e(x0) of winners and losers under the model's current weights: one batched velocity call."""
        device = getattr(model, "device", torch.device("cpu"))
        x0 = torch.stack([u.chosen for u in units] + [u.rejected for u in units]).to(device)
        eps = torch.stack([u.eps for u in units] * 2).to(device)
        s = torch.stack([u.sigma for u in units] * 2).to(device)
        # pairs of sources of other sizes (an editing model's) do not share one call
        v = grouped_velocity(model, noised(x0, eps, s), s, [u.cond for u in units] * 2)
        err = mean_over_dims((v.float() - velocity_target(x0, eps)) ** 2)
        n = len(units)
        return err[:n], err[n:]

    # -- checkpoints: the online reference snapshot and when it was taken ------------------------
    def state(self) -> dict[str, Any]:
        return {"snapshot_step": self._snapshot_step}

    def load_state(self, state: dict[str, Any]) -> None:
        self._snapshot_step = int(state.get("snapshot_step", 0))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.snapshot.state_dict() if self.snapshot is not None else {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], model: Any) -> None:
        self.snapshot = ShadowParameters(model.trainable_parameters())
        self.snapshot.load_state_dict(tensors)

    def _refresh_snapshot(self, model: Any, step: int) -> None:
        every = self.options.ref_update_every
        if self.snapshot is None:
            self.snapshot = ShadowParameters(model.trainable_parameters())
            self._snapshot_step = step
        elif every is not None and step - self._snapshot_step >= every:
            self.snapshot.copy_from_params()
            self._snapshot_step = step

    def prepare(self, model: Any, units: list[PreferencePair]) -> dict[str, float]:
        """Without grad: encode offline pairs; with an online reference snapshot (``ref_update_every``), its
        errors (the base model's, ``uses_reference``, come through ``reference_prepare``)."""
        if units[0].chosen is None:
            self._encode_offline(model, units)
        if not self.uses_reference:
            self._refresh_snapshot(model, units[0].step)
            assert self.snapshot is not None
            with self.snapshot.swapped():
                self._store_reference_errors(model, units)
        return {"dpo/reference_step": float(self._snapshot_step)} if not self.uses_reference else {}

    def loss(self, model: Any, units: list[PreferencePair], first_update: bool = False):
        err_w, err_l = self._errors(model, units)
        ref = torch.stack([u.ref_error for u in units]).to(err_w.device)
        per_pair, delta = dpo_loss(err_w, err_l, ref[:, 0], ref[:, 1], self.options.beta)
        loss = per_pair.mean()
        gaps = [u.reward_gap for u in units if u.reward_gap == u.reward_gap]
        metrics = {
            "dpo/loss": float(loss.detach()),
            "dpo/accuracy": float((delta.detach() < 0).float().mean()),
            "dpo/implicit_margin": float((-0.5 * self.options.beta * delta.detach()).mean()),
            "dpo/err_chosen": float(err_w.detach().mean()),
            "dpo/err_rejected": float(err_l.detach().mean()),
        }
        if gaps:
            metrics["dpo/reward_gap"] = sum(gaps) / len(gaps)
        return loss, metrics
