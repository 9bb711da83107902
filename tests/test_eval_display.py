"""What a reward displays beside its score in an evaluation (``Reward.display_for``: an affine function of the
score, as asr-error's raw CER = 1 - score): read from the reward's class and options without building it, written
per sample, per prompt and overall in ``results.json`` (compared like the scores), labelled in the report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from omnirl_core import hookimpl
from omnirl_core.contracts import Reward
from omnirl_core.contracts.reward import ScoreDisplay
from omnirl_core.loop.evaluation import (
    EvalResult,
    Evaluator,
    compare,
    evaluate,
    reward_displays,
    write_results,
)
from omnirl_core.registry import RewardSpec
from omnirl_core.rundir.report import build_report
from omnirl_core.rundir.rundir import RunDir


class DarknessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    show: bool = Field(True, description="Display the mean brightness beside the score.")


class Darkness(Reward):
    """1 - the image's mean value; displays the brightness itself (1 - score) when ``show``."""

    built = 0

    @classmethod
    def display_for(cls, options: DarknessOptions | None) -> ScoreDisplay | None:
        return ScoreDisplay("brightness", scale=-1.0, offset=1.0) if (options or DarknessOptions()).show else None

    def __init__(self, options: DarknessOptions | None = None):
        Darkness.built += 1

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str], **kwargs: object) -> list[float]:
        return [1.0 - float(o.mean()) for o in outputs]


def plain_reward(options: object = None) -> Any:
    return lambda outputs, prompts: [0.5 for _ in outputs]


class _TestRewards:
    """A test plugin, registered explicitly: a reward class that declares a display, and a plain function."""

    @hookimpl
    def omnirl_register_rewards(self, register):
        register(RewardSpec(name="darkness", factory=Darkness, config=DarknessOptions, modality="image"))
        register(RewardSpec(name="plain", factory=plain_reward, modality="image"))


def _resolve(manager, tmp_path: Path, show: bool = True):
    from omnirl_core.resolve import resolve_run

    manager.load_modules(["omnirl_plugin_cpu", "omnirl_plugin_qwen_image", "omnirl_plugin_flowgrpo",
                          "omnirl_plugin_diffusers", "omnirl_plugin_torch"])
    manager.register(_TestRewards(), "test-rewards")
    return resolve_run(manager, [{
        "model": {"name": "qwen-image", "preset": "tiny"}, "algorithm": {"name": "flowgrpo"},
        "rewards": [{"name": "darkness", "options": {"show": show}}, {"name": "plain", "weight": 0.0}],
        "rollout": {"num_steps": 2, "height": 32, "width": 32},
        "run": {"device": "cpu", "output_dir": str(tmp_path / "run")}}], probe_device=False)


def test_displays_are_read_from_the_class_and_options_without_building_the_reward(manager, tmp_path: Path):
    before = Darkness.built
    assert reward_displays(_resolve(manager, tmp_path)) == {"darkness": ScoreDisplay("brightness", -1.0, 1.0)}
    assert Darkness.built == before  # nothing was built
    assert Reward.display_for(None) is None and ScoreDisplay("x", 2.0, -1.0)(0.75) == 0.5


def test_no_display_when_the_options_say_so(manager, tmp_path: Path):
    assert reward_displays(_resolve(manager, tmp_path, show=False)) == {}


def test_eval_writes_the_displayed_metric_per_sample_per_prompt_and_overall(manager, tmp_path: Path):
    resolved = _resolve(manager, tmp_path)
    evaluator = Evaluator(resolved)
    records = [{"prompt": "a red car"}, {"prompt": "a dark night"}]
    result = evaluate(evaluator.generate, records, resolved.config, 2, 0, "base", displays=evaluator.displays)
    assert result.metrics == ["reward", "darkness", "plain", "darkness/brightness"]
    brightness = [float(o.mean()) for o in result.outputs]  # the quantity displayed, computed here
    assert [r["darkness/brightness"] for r in result.rows] == pytest.approx(brightness, abs=1e-6)
    assert all("plain/" not in key for row in result.rows for key in row)  # a plain function displays nothing
    directory = tmp_path / "run" / "eval" / "step-000000"
    data = json.loads(write_results(directory, [result], {"step": 0}, samples_per_prompt=2).read_text())
    model = data["models"]["base"]
    assert data["displayed"] == {"darkness/brightness": {"reward": "darkness", "scale": -1.0, "offset": 1.0,
                                                         "lower_is_better": True}}
    assert [p["darkness/brightness"] for p in model["per_prompt"]] == pytest.approx(
        [statistics.fmean(brightness[:2]), statistics.fmean(brightness[2:])], abs=1e-6)
    assert model["summary"]["darkness/brightness"]["mean"] == pytest.approx(statistics.fmean(brightness), abs=1e-6)
    assert model["summary"]["darkness/brightness"]["mean"] == pytest.approx(
        1 - model["summary"]["darkness"]["mean"], abs=1e-9)
    # compared like a score: the paired difference of the displayed values
    brighter = EvalResult("trained", result.metrics, rows=[
        {**r, "darkness": r["darkness"] - 0.25, "darkness/brightness": r["darkness/brightness"] + 0.25}
        for r in result.rows])
    assert compare(result, brighter)["darkness/brightness"]["diff"] == pytest.approx(0.25)

    RunDir(tmp_path / "run").prepare({"model": {"name": "qwen-image"}, "rewards": [{"name": "darkness"}],
                                      "run": {"steps": 0}}, [])
    page = build_report(tmp_path / "run")
    assert "<td>darkness/brightness = 1 - darkness (lower is better)</td>" in page
    assert f"<td>{model['summary']['darkness/brightness']['mean']:.4f} ± " in page
