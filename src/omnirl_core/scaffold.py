"""``omnirl plugin new KIND NAME``: a plugin package that installs, is listed, and passes its own tests at once.

Each kind's template is the smallest real plugin of that kind (a reward that scores, an algorithm that
trains, a tracker that writes, a device that probes), declared in an ``omnirl.toml`` manifest, with a test
that uses the core's checks (``omnirl_core.testing``). Replace the logic, keep the shape.
"""

from __future__ import annotations

import re
from pathlib import Path

from omnirl_core.errors import UsageError

KINDS = ("reward", "algorithm", "tracker", "device")
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

TEMPLATES: dict[str, dict[str, str]] = {
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
    }
    for rel, text in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target
