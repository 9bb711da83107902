"""``omnirl plugin new KIND NAME``: a plugin package that installs, is listed, and passes its own tests at once.

Each kind's template is the smallest real plugin of that kind (a reward that scores, an algorithm that
trains, a tracker that writes, a device that probes, a flow model on the diffusers kit with a tiny random-weight
preset, a rollout engine over the core sampler), declared in an ``omnirl.toml`` manifest, with tests that use the
core's checks (``omnirl_core.testing``: the flow-model suites, the engine contract suites). Replace the logic, keep
the shape.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omnirl_core.errors import UsageError

KINDS = ("reward", "algorithm", "tracker", "device", "model", "engine")
NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "omnirl-plugin-{name}"
version = "0.1.0"
description = "omnirl {kind} plugin: {name}."
requires-python = ">=3.10"
dependencies = ["omnirl>=0.1"{deps}]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points."omnirl.plugins"]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]

[tool.setuptools.package-data]
{package} = ["omnirl.toml"]

[tool.pytest.ini_options]
addopts = "--import-mode=importlib"
'''

README = '''# omnirl-plugin-{name}

An omnirl {kind} plugin (made by `omnirl plugin new {kind} {name}`).

```bash
pip install -e .          # then: omnirl list {listing} {name} --options
pytest tests
```

Replace the logic in `{package}/{module}.py`; the {kind} is declared in `{package}/omnirl.toml`
(keep `{package}/__init__.py` cheap to import: no torch). See CONTRIBUTING.md in the omnirl repository.
'''

INIT = '''"""omnirl {kind} plugin: {name} (declared in omnirl.toml). {about}"""
'''

MANIFEST = '''[[{kind}]]
name = "{name}"
description = "{description}"
factory = "{package}.{module}:{factory}"
'''
CONFIG = 'config = "{package}.{module}:{cls}Options"\n'

TEMPLATES: dict[str, dict[str, Any]] = {
    "reward": {
        "listing": "rewards",
        "module": "reward",
        "deps": ', "torch>=2.4"',
        "about": "Cheap to import: no torch.",
        "description": "Mean brightness of an image, times a scale (replace with your objective).",
        "factory": "{cls}",
        "manifest": '''modality = "image"
default_prompts = ["a bright sunny beach", "a white snowy field", "a lit lamp", "a glowing moon"]
''',
        "code": '''"""The {name} reward: called with a batch of decoded images (float tensors (3, H, W) in [0, 1]) and their
prompts; returns one finite float per image, higher is better."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward


class {cls}Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = Field(1.0, description="Multiplies the score.")


class {cls}(Reward):
    batch_invariant = True  # each image scored on its own

    def __init__(self, options: {cls}Options | None = None):
        self.options = options or {cls}Options()

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: Any) -> list[float]:
        return [self.options.scale * float(image.float().mean()) for image in outputs]
''',
        "test": '''import torch

from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing import check_reward
from {package}.reward import {cls}, {cls}Options


def test_scores_follow_brightness():
    dark, bright = torch.full((3, 16, 16), 0.1), torch.full((3, 16, 16), 0.9)
    scores = check_reward({cls}({cls}Options(scale=2.0)), [dark, bright], ["a", "b"])
    assert scores[1] > scores[0]
    assert abs(scores[1] - 1.8) < 1e-6


def test_listed_and_loadable():
    spec = get_plugin_manager().resolve("reward", "{name}")
    reward = spec.load_factory()(spec.load_config()())
    assert len(check_reward(reward, [torch.rand(3, 8, 8)], ["x"])) == 1
''',
    },
    "algorithm": {
        "listing": "algos",
        "module": "algorithm",
        "deps": ', "torch>=2.4"',
        "about": "Cheap to import: no torch.",
        "description": "A GRPO-style policy gradient on every SDE step (replace with your objective).",
        "factory": "{cls}",
        "manifest": '''requires = ["flow-matching", "sde-logprob"]  # the model capabilities it needs
needs_reference = true
''',
        "code": '''"""The {name} algorithm: FlowGRPO's structure (``FlowPolicyGradient``: group advantages, clipped ratio,
exact Gaussian KL), with every denoising step stochastic and trained. Override ``plan`` (which steps are
SDE and trained), ``surrogate`` (the per-transition objective) or ``transition_kl``."""

from __future__ import annotations

from pydantic import Field

from omnirl_core.contracts import RolloutPlan
from omnirl_core.flow.policy_gradient import FlowPolicyGradient, FlowPolicyGradientOptions


class {cls}Options(FlowPolicyGradientOptions):
    """FlowPolicyGradient's options (noise_level, clip_range, beta, adv_clip, global_std) and this algorithm's."""

    sde_steps: int | None = Field(None, ge=1, description="Train only the first N denoising steps (None: all).")


class {cls}(FlowPolicyGradient):
    def __init__(self, options: {cls}Options | None, config):
        super().__init__(options or {cls}Options(), config)
        steps = tuple(range(min(self.num_steps, self.options.sde_steps or self.num_steps)))
        kinds = ("sde",) * len(steps) + ("ode",) * (self.num_steps - len(steps))
        self._plan = RolloutPlan(step_kinds=kinds, train_steps=steps, eta=self.options.noise_level)

    def plan(self, step: int) -> RolloutPlan:
        return self._plan
''',
        "test": '''import torch

from omnirl_core.config import RunConfig
from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing.algorithm import check_algorithm_step
from {package}.algorithm import {cls}, {cls}Options


def test_every_step_is_stochastic_and_trained():
    config = RunConfig()
    config.rollout.num_steps = 4
    plan = {cls}({cls}Options(), config).plan(1)
    assert plan.step_kinds == ("sde",) * 4 and plan.train_steps == (0, 1, 2, 3)


def test_a_training_step_on_the_core_toy_model_changes_the_weights():
    metrics = check_algorithm_step(lambda config: {cls}({cls}Options(), config))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_listed():
    assert get_plugin_manager().resolve("algorithm", "{name}").name == "{name}"
''',
    },
    "tracker": {
        "listing": "trackers",
        "module": "tracker",
        "deps": "",
        "about": "Cheap to import.",
        "description": "Every step's metrics as CSV rows in RUN_DIR/{name}.csv (replace with your service).",
        "factory": "{cls}",
        "manifest": "",
        "code": '''"""The {name} tracker: ``start`` once per run (``run.start_step`` > 1 on a resume), ``log`` per step,
``close`` at the end."""

from __future__ import annotations

import csv
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Tracker
from omnirl_core.loop.trackers import StepEvent, TrackerRun


class {cls}Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="CSV file; None: RUN_DIR/{name}.csv.")


class {cls}(Tracker):
    def __init__(self, options: {cls}Options | None = None):
        self.options = options or {cls}Options()
        self.path: Path | None = None

    def start(self, run: TrackerRun) -> None:
        self.path = Path(self.options.path) if self.options.path else run.run_dir / "{name}.csv"

    def log(self, event: StepEvent) -> None:
        assert self.path is not None
        new = not self.path.exists()
        with self.path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "key", "value"])
            writer.writerows([event.step, k, v] for k, v in sorted(event.metrics.items()))

    def close(self) -> None:
        pass
''',
        "test": '''from pathlib import Path

from omnirl_core.plugins import get_plugin_manager
from omnirl_core.loop.trackers import StepEvent, TrackerRun
from {package}.tracker import {cls}


def test_writes_every_metric(tmp_path: Path):
    tracker = {cls}()
    tracker.start(TrackerRun(run_dir=tmp_path, name="run", config={{}}, start_step=1))
    tracker.log(StepEvent(step=1, metrics={{"reward/mean": 0.5, "loss": 0.1}}))
    tracker.close()
    rows = (tmp_path / "{name}.csv").read_text().splitlines()
    assert rows == ["step,key,value", "1,loss,0.1", "1,reward/mean,0.5"]


def test_listed():
    assert get_plugin_manager().resolve("tracker", "{name}").name == "{name}"
''',
    },
    "device": {
        "listing": "devices",
        "module": "device",
        "deps": "",
        "about": "Cheap to import: the probe imports what it needs.",
        "description": "Replace: your accelerator's torch device, distributed backend and Ray resource.",
        "factory": "probe",
        "manifest": '''# the factory is the probe: () -> the number of usable devices; cheap, never raises
torch_device = "cpu"
backend = "gloo"
ray_resource = "CPU"
visible_devices_env = ""
priority = -1  # --device auto picks the available device with the highest priority
''',
        "code": '''"""The {name} device's probe: how many devices this process can use. Cheap, and never raises (an
exception would make the plugin look broken on machines without the device)."""


def probe() -> int:
    try:
        import torch

        return 1 if torch.device("cpu") else 0  # replace: e.g. torch.xpu.device_count()
    except Exception:
        return 0
''',
        "test": '''from omnirl_core.plugins import get_plugin_manager
from {package}.device import probe


def test_probe_counts_devices():
    assert probe() >= 0


def test_listed_and_available():
    spec = get_plugin_manager().resolve("device", "{name}")
    assert spec.available() == probe()
''',
    },
    "model": {
        "listing": "models",
        "module": "model",
        "deps": (', "torch>=2.4,<3", "diffusers>=0.35", "transformers>=4.51", "accelerate>=0.30", "peft>=0.15", '
                 '"tokenizers>=0.20"'),
        "about": "Cheap to import: no torch.",
        "description": "A text-to-image flow model on the diffusers flow-model kit (replace with yours).",
        "factory": "create_model",
        "manifest": '''capabilities = ["flow-matching", "sde-logprob", "cfg", "lora", "image"]
presets = ["tiny"]
default_path = "lodestones/Chroma1-HD"

# what resolution refuses before any weight loads: sizes must be multiples of the VAE scale x the 2x2 patches
[model.limits]
tiny = {{ size_multiple = 8 }}
default = {{ size_multiple = 16 }}

[model.recipe_defaults]
rollout = {{ height = 512, width = 512, num_steps = 16, guidance_scale = 4.0 }}

[model.preset_defaults.tiny]
extends = "omnirl_core.presets:TINY_IMAGE_DEFAULTS"
rewards = [{{ name = "color" }}]
model = {{ options = {{ max_sequence_length = 16 }} }}
''',
        "code": '''"""The {name} model behind the omnirl flow-model contract, on the diffusers flow-model kit.

The kit (``omnirl_core.flow.model.DiffusersFlowModel``) does what diffusers flow models share: latents as the
(C, H/8, W/8) grid, packed into 2x2 patches for the transformer (``packed``); the pipeline's size-shifted schedule
from linspace(1, 1/T) (``linspace_sigmas``); true classifier-free guidance v = v_u + g (v_c - v_u); VAE decoding and
encoding; LoRA; weights saved as diffusers reads them. A model writes ``encode`` and ``forward``.

The template is diffusers' ChromaPipeline architecture (a FLUX-style MMDiT, one T5 text encoder, true CFG with the
formula above); for another pipeline change the pipeline class, ``encode``, ``forward``, the class attributes and
``tiny.py``. Conventions: sigma runs from 1 (noise) to 0 (data), x = (1 - s) x0 + s eps, the network predicts
v = eps - x0; convert to the network's own timestep inside ``forward``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from omnirl_core.config import ModelSection
from omnirl_core.contracts import Conditioning
from omnirl_core.flow.model import DiffusersFlowModel, DiffusersModelOptions, create_flow_model

DEFAULT_PATH = "lodestones/Chroma1-HD"  # the hub id (or directory) loaded without --preset tiny or model.path


class {cls}Options(DiffusersModelOptions):
    max_sequence_length: int = Field(512, ge=1, le=512, description="Prompt tokens: every prompt is padded to "
                                     "this length, its padding masked.")
    # diffusers' ChromaTransformer2DModel (0.42) drops the text mask of its single-stream blocks when it checkpoints
    # them, which changes the numbers: refused until it does not (check_model_plugin's blocks= checks it)
    gradient_checkpointing: Literal[False] = Field(
        False, description="Not available: the transformer computes other numbers with gradient checkpointing.")


class {cls}(DiffusersFlowModel):
    label = "{name}"
    capabilities = frozenset({{"flow-matching", "sde-logprob", "cfg", "lora", "image"}})
    guidance = "cfg"  # true CFG: a second, unconditional branch
    packed = True  # the transformer reads 2x2-patch tokens
    linspace_sigmas = True  # the pipeline passes linspace(1, 1/T) to the scheduler
    # joint attention of both streams and both feed-forwards (double blocks), attention and MLP-in (single blocks)
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
    )

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Conditioning:
        # each prompt padded to max_sequence_length with its mask, as the pipeline does: a prompt's tensors do not
        # depend on the other prompts of its batch
        embeds, mask = self.pipeline._get_t5_prompt_embeds(
            list(prompts), max_sequence_length=self.options.max_sequence_length, device=self.device, dtype=self.dtype)
        return Conditioning({{"prompt_embeds": embeds, "prompt_mask": mask}}, pad_keys=("prompt_embeds", "prompt_mask"))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, grid: tuple[int, int],
                guidance: float | None) -> torch.Tensor:
        embeds = cond.tensors["prompt_embeds"].to(self.dtype)
        # the text mask extended over the image tokens, a float mask as the pipeline passes it
        image = torch.ones(x.shape[0], x.shape[1], device=self.device, dtype=self.dtype)
        mask = torch.cat([cond.tensors["prompt_mask"].to(self.dtype), image], dim=1)
        out = self.denoiser(
            hidden_states=x,
            timestep=(sigma.float() * 1000).to(self.dtype) / 1000,  # the pipeline's t / 1000, t = 1000 sigma
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=self.pipeline._prepare_latent_image_ids(None, grid[0] // 2, grid[1] // 2, self.device, self.dtype),
            attention_mask=mask,
            return_dict=False,
        )[0]
        return out.float()


def create_model(section: ModelSection, options: {cls}Options | None, device: Any) -> {cls}:
    """The spec's factory: the checkpoint (``--preset tiny``, ``model.path`` or ``DEFAULT_PATH``) loaded through
    ``from_pretrained``, on ``device``."""
    from diffusers import ChromaPipeline

    from {package}.tiny import TINY_VERSION, build_tiny_pipeline

    options = options or {cls}Options()
    return create_flow_model({cls}, ChromaPipeline, section, options, device, label="{name}", default=DEFAULT_PATH,
                             tiny=("{name}", TINY_VERSION, build_tiny_pipeline))
''',
        "files": {
            "{package}/tiny.py": '''"""The ``tiny`` preset: the model's architecture (double- and single-stream transformer blocks, a T5 text encoder, a
VAE with shift and scale) with random weights, built in seconds from constructor arguments, cached on disk in the
diffusers layout (``tiny_directory``) and loaded back through ``from_pretrained`` like a released checkpoint."""

from __future__ import annotations

import torch

from omnirl_core import presets

TINY_VERSION = 1  # bump when the tiny architecture changes (invalidates the on-disk cache)
TEXT_DIM, LATENT_CHANNELS = 32, 4


def build_tiny_pipeline(seed: int = 0):
    """A ChromaPipeline with random weights: 1 double + 1 single block of 2 heads x 16 (rotary axes 4/6/6), a VAE
    with 4 latent channels (x4), a T5 encoder of d_model 32 and 2 layers over the small built-in tokenizer."""
    from diffusers import (
        AutoencoderKL,
        ChromaPipeline,
        ChromaTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    tokenizer = presets.t5_tokenizer()
    torch.manual_seed(seed)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=32, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.1159, scaling_factor=0.3611,
    )
    # random decoders map every latent to flat grey: widen their range so that a colour reward has room to move
    presets.widen_decoder_range(lambda z: vae.decode(z, return_dict=False)[0], vae.decoder.conv_out,
                                (2, LATENT_CHANNELS, 8, 8))
    text_encoder = presets.tiny_t5_encoder(tokenizer, d_model=TEXT_DIM, d_kv=8, d_ff=37, seed=seed + 2)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
''',
        },
        "test": '''"""The {name} model on its tiny preset: the from_pretrained round trip, the core's flow-model suites (contract,
batch invariance, rollout/trainer log-prob agreement, the LoRA loaded into the pipeline), the pipeline's own
denoising reproduced by velocity + schedule, and a short training run through the real CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from omnirl_core import testing
from omnirl_core.config import ModelSection
from omnirl_core.flow.model import load_diffusers_pipeline, pack_2x2, save_pipeline
from omnirl_core.plugins import get_plugin_manager
from {package}.model import {cls}Options, create_model
from {package}.tiny import build_tiny_pipeline

SIZE = 32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_pipeline(build_tiny_pipeline(seed=3), tmp_path_factory.mktemp("{name}-tiny"))


def _load(path: Path):
    from diffusers import ChromaPipeline

    return load_diffusers_pipeline(ChromaPipeline, str(path), torch.float32, "{name}")


def _model(path: Path, lora: bool = True):
    options = {cls}Options(max_sequence_length=16)
    return testing.trainable(create_model(ModelSection(name="{name}", path=str(path)), options, "cpu"), lora)


def _render(pipe, steps: int = 2):
    return testing.render(pipe, steps, height=SIZE, width=SIZE, guidance_scale=4.0, max_sequence_length=16)


def test_tiny_preset_reloads_through_from_pretrained(tiny_dir: Path):
    torch.testing.assert_close(_render(_load(tiny_dir)), _render(_load(tiny_dir)))


def test_every_model_suite(tiny_dir: Path, tmp_path: Path):
    """``check_model_plugin``: the contract (shapes, guidance, reference, decode, batch invariance), the trainer's
    log-probs equal to the rollout's with true CFG, and the saved LoRA loaded into the pipeline. A model that
    supports gradient checkpointing adds ``blocks=`` and ``large_size=`` (the same gradients, fewer activations)."""
    testing.check_model_plugin(lambda gradient_checkpointing: _model(tiny_dir), SIZE, SIZE, guidance_scale=4.0,
                               directory=tmp_path / "ckpt", load_pipeline=lambda: _load(tiny_dir), render=_render)


def test_gradient_checkpointing_is_refused_with_its_reason():
    with pytest.raises(ValidationError, match="gradient_checkpointing"):
        {cls}Options(gradient_checkpointing=True)


def test_velocity_and_schedule_reproduce_the_pipeline_denoising(tiny_dir: Path):
    """Our schedule + guided velocity + Euler steps give the pipeline's own latents (its negative prompt: "")."""
    from omnirl_core.flow.sampler import sample_step

    model = _model(tiny_dir, lora=False)
    shape = model.latent_shape(SIZE, SIZE)
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(5))
    expected = model.pipeline(prompt="a red square", height=SIZE, width=SIZE, num_inference_steps=4,
                              guidance_scale=4.0, latents=pack_2x2(x), output_type="latent",
                              max_sequence_length=16).images
    cond, uncond, sigmas = model.encode(["a red square"]), model.encode([""]), model.sigmas(4, shape)
    with torch.no_grad():
        for i in range(4):
            s, s_next = sigmas[i:i + 1], sigmas[i + 1:i + 2]
            x = sample_step("ode", x, model.velocity(x, s, cond, 4.0, uncond), s, s_next, 0.0).prev_sample
    torch.testing.assert_close(pack_2x2(x), expected, atol=1e-5, rtol=1e-5)


def test_listed_with_its_capabilities():
    spec = get_plugin_manager().resolve("model", "{name}")
    assert {{"flow-matching", "cfg", "lora"}} <= spec.capabilities and "tiny" in spec.presets


def test_importing_the_plugin_is_cheap():
    testing.check_import_is_cheap("{package}")


def test_a_short_training_run_through_the_cli(tmp_path: Path):
    if "flowgrpo" not in testing.installed_algorithms():
        pytest.skip("the flowgrpo algorithm plugin is not installed")
    records = testing.run_train(tmp_path / "run", "--model", "{name}", "--algo", "flowgrpo", "--preset", "tiny",
                                "--steps", "2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
                                "--set", "rollout.num_steps=3", "--set", "run.sample_every=2")
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward/mean"]) for r in records)
''',
    },
    "engine": {
        "listing": "engines",
        "module": "engine",
        "deps": ', "torch>=2.4,<3"',
        "about": "Cheap to import: no torch.",
        "description": "A rollout engine: the core sampler over the flow-model contract, one batch at a time "
                       "(replace with yours).",
        "factory": "{cls}",
        "manifest": '''roles = ["rollout"]
batch_option = "max_batch_size"  # what `omnirl plan` suggests lowering when a rollout does not fit
devices = ["cpu", "cuda"]
''',
        "code": '''"""The {name} rollout engine: requests grouped by what can share a ``velocity`` call (latent shape, guidance scale,
plan), each group denoised in batches of ``max_batch_size`` by the core's sampler (``omnirl_core.flow.sampler``),
decoded, and handed out with the trajectory the trainer re-evaluates.

Batch invariance: each request draws its initial latent and its step noise from its own seeded generators, and its
prompt is encoded on its own, so a sample does not depend on what shared its batch (up to float rounding).
``plugins/engines/diffusers`` adds step-wise continuous batching, a prompt-embedding cache and arrival times;
``omnirl_core.serving.rollout_server.ServedRolloutEngine`` is the base of an engine that runs in a server of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Conditioning, GenRequest, RolloutEngine, RolloutPlan, Sample
from omnirl_core.flow.sampler import DETERMINISTIC, sample_step


class {cls}Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch_size: int = Field(8, ge=1, description="Most requests in one velocity call.")


class {cls}(RolloutEngine):
    def __init__(self, model: Any, options: {cls}Options | None, device: Any):
        self.model = model
        self.options = options or {cls}Options()
        self.device = torch.device(device)

    def generate(self, requests: list[GenRequest]) -> Iterator[Sample]:
        groups: dict[tuple[Any, ...], list[GenRequest]] = {{}}
        for r in requests:
            shape = tuple(self.model.latent_shape(r.height, r.width, r.num_frames))
            groups.setdefault((shape, float(r.guidance_scale), r.plan), []).append(r)
        size = self.options.max_batch_size
        for (shape, scale, plan), group in groups.items():
            for start in range(0, len(group), size):
                yield from self._run(group[start:start + size], shape, scale, plan)

    @torch.no_grad()
    def _run(self, batch: list[GenRequest], shape: tuple[int, ...], scale: float, plan: RolloutPlan
             ) -> Iterator[Sample]:
        n, model, device = len(batch), self.model, self.device
        sigmas = plan.sigmas_from(model.sigmas(plan.schedule_steps, shape)).float().cpu()
        conds = [model.encode([r.prompt]) for r in batch]
        uncond = model.encode([model.negative_prompt]) if scale > 1.0 else None
        cond = Conditioning.cat(conds).to(device)
        uncond_batch = Conditioning.cat([uncond] * n).to(device) if uncond is not None else None
        x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
            r.noise_seed if r.noise_seed is not None else r.seed)) for r in batch]).to(device)
        noise = [torch.Generator().manual_seed(r.seed + 1) for r in batch]
        states, logprobs, history = [x.cpu()], torch.full((n, plan.num_steps), float("nan")), None
        sigma_max = sigmas[1].expand(n).to(device)  # the Flow-SDE's stand-in for s = 1
        for i, kind in enumerate(plan.step_kinds):
            s, s_next = sigmas[i].expand(n).to(device), sigmas[i + 1].expand(n).to(device)
            v = model.velocity(x, s, cond, scale, uncond_batch)
            eps = None
            if kind not in DETERMINISTIC:
                eps = torch.stack([torch.randn(shape, generator=g) for g in noise]).to(device)
            out = sample_step(kind, x, v, s, s_next, plan.eta, eps, sigma_max, history)
            history, x = (out.x0, s), out.prev_sample
            states.append(x.cpu())
            if out.logprob is not None:
                logprobs[:, i] = out.logprob.float().cpu()
        outputs = model.decode(x).cpu()
        trajectory = torch.stack(states, dim=1)
        for k, r in enumerate(batch):  # clones: a row of a batch tensor would carry the whole batch's storage
            yield Sample(request=r, latents=trajectory[k].clone(), sigmas=sigmas.clone(), logprobs=logprobs[k].clone(),
                         output=outputs[k].clone(), cond=conds[k], uncond=uncond)
''',
        "test": '''"""The {name} rollout engine against the core's rollout-engine contract suite on the core's toy flow model (no
model plugin): one sample per request with its request, trajectories, per-request seeds, the trainer's
re-evaluation of the log-probs."""

from __future__ import annotations

import pytest

from omnirl_core.plugins import get_plugin_manager
from omnirl_core.testing.engines import check_rollout_engine, toy_flow_model
from {package}.engine import {cls}, {cls}Options


@pytest.fixture(scope="module")
def model():
    return toy_flow_model()


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_the_rollout_engine_contract(model, max_batch_size: int):
    samples = check_rollout_engine(lambda m: {cls}(m, {cls}Options(max_batch_size=max_batch_size), "cpu"),
                                   model=model)
    assert len(samples) == 6


def test_listed_as_a_rollout_engine():
    spec = get_plugin_manager().resolve("engine", "{name}")
    assert spec.roles == frozenset({{"rollout"}}) and spec.load_factory() is {cls}
''',
    },
}


def new_plugin(kind: str, name: str, parent: Path = Path(".")) -> Path:
    """Write ``parent/NAME`` (a directory that must not exist) and return it."""
    if kind not in TEMPLATES:
        raise UsageError(f"Unknown plugin kind '{kind}'.", hint=f"Choose one of: {', '.join(KINDS)}.")
    if not NAME.match(name):
        raise UsageError(f"Plugin name '{name}' is not a lowercase name with dashes (e.g. 'my-reward').",
                         hint="Use letters, digits and single dashes, starting with a letter.")
    target = parent / name
    if target.exists():
        raise UsageError(f"'{target}' exists already.", hint="Pick another name or remove the directory.")
    t = TEMPLATES[kind]
    package = "omnirl_plugin_" + name.replace("-", "_")
    cls = "".join(part.capitalize() for part in name.split("-"))
    values = {"name": name, "kind": kind, "package": package, "cls": cls, "deps": t["deps"],
              "listing": t["listing"], "module": t["module"]}
    files = {
        "pyproject.toml": PYPROJECT.format(**values),
        "README.md": README.format(**values),
        f"{package}/__init__.py": INIT.format(**values, about=t["about"]),
        f"{package}/omnirl.toml": (MANIFEST.format(**values, description=t["description"].format(**values),
                                                   factory=t["factory"].format(**values))
                                   + (CONFIG.format(**values) if kind != "device" else "")
                                   + t["manifest"].format(**values)),
        f"{package}/{t['module']}.py": t["code"].format(**values),
        f"tests/test_{package[len('omnirl_plugin_'):]}.py": t["test"].format(**values),
        **{rel.format(**values): text.format(**values) for rel, text in t.get("files", {}).items()},
    }
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target
