"""answer-match: extraction rules, errors on missing references, and the core passing prompt records to it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omnirl_plugin_answer_match.reward import AnswerMatch, AnswerMatchOptions, extract_boxed, extract_choice
from omnirl_plugin_answer_match.tasks import CHOICE_QUESTIONS

from omnirl_core.data.sources import load_records
from omnirl_core.rewards.dispatch import RewardError, RewardFn, RewardSet


@pytest.mark.parametrize("text, expected", [
    ("B", "B"), ("(C)", "C"), ("D) cold", "D"), ("  A. four", "A"), ("The answer is (B).", "B"),
    ("answer: c", None), ("Answer: C", "C"), ("CA", None), ("Because it is blue", None), ("", None), ("E", None),
])
def test_choice_extraction(text: str, expected: str | None):
    assert extract_choice(text, "ABCD") == expected


def test_choice_scores_against_each_prompts_answer():
    reward = AnswerMatch()
    outputs = ["B", "B", "A", "The answer is C"]
    records = [{"answer": "B"}, {"answer": "A"}, {"answer": "(A)"}, {"answer": "C"}]
    assert reward(outputs, ["q"] * 4, inputs=records) == [1.0, 0.0, 1.0, 1.0]


def test_number_boxed_and_exact_modes():
    number = AnswerMatch(AnswerMatchOptions(extract="number"))
    assert number(["so she has 1,250 apples", "about 3.5 or 4", "none"], ["q"] * 3,
                  inputs=[{"answer": 1250}, {"answer": "4"}, {"answer": 0}]) == [1.0, 1.0, 0.0]
    boxed = AnswerMatch(AnswerMatchOptions(extract="boxed"))
    assert extract_boxed(r"x = \boxed{\frac{1}{2}} so") == r"\frac{1}{2}"
    assert boxed([r"\boxed{ 1/2 }", r"\boxed{2", "1/2"], ["q"] * 3, inputs=[{"answer": "1/2"}] * 3) == [1.0, 0.0, 0.0]
    exact = AnswerMatch(AnswerMatchOptions(extract="exact", answer_key="label"))
    assert exact(["  Paris ", "paris", "Paris, France"], ["q"] * 3, inputs=[{"label": "Paris"}] * 3) == [1.0, 1.0, 0.0]
    strict = AnswerMatch(AnswerMatchOptions(extract="exact", case_sensitive=True))
    assert strict(["paris"], ["q"], inputs=[{"answer": "Paris"}]) == [0.0]


def test_a_missing_reference_is_an_error_not_a_zero():
    reward = AnswerMatch()
    with pytest.raises(ValueError, match="no reference answer in its record field 'answer'"):
        reward(["B"], ["Which?"], inputs=[{}])
    with pytest.raises(ValueError, match="not one of the choices"):
        reward(["B"], ["Which?"], inputs=[{"answer": "Z"}])


def _sample(prompt: str, output: str, inputs: dict):
    return SimpleNamespace(prompt=prompt, output=output, request=SimpleNamespace(inputs=inputs), rewards={},
                           reward=float("nan"))


def test_the_core_passes_each_prompts_record_from_a_jsonl_file(tmp_path: Path):
    from PIL import Image

    (tmp_path / "pics").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "pics" / "1.png")  # the data layer checks that an image reads
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "one?", "answer": "A", "image": "pics/1.png"},
                                                      {"prompt": "two?", "answer": "B"}]))
    records = load_records(str(data))
    assert records[0]["image"] == str(tmp_path / "pics" / "1.png")  # media paths relative to the file
    samples = [_sample(r["prompt"], "B", {k: v for k, v in r.items() if k != "prompt"}) for r in records]
    RewardSet([RewardFn("answer-match", AnswerMatch())]).score(samples)
    assert [s.reward for s in samples] == [0.0, 1.0]
    broken = [_sample("three?", "B", {})]
    with pytest.raises(RewardError, match="no reference answer"):
        RewardSet([RewardFn("answer-match", AnswerMatch())]).score(broken)


def test_the_default_task_is_a_fixed_letter_with_the_right_option_under_it():
    reward = AnswerMatch()
    for q in CHOICE_QUESTIONS:
        assert q["answer"] == "B"
        assert reward(["B"], [q["prompt"]], inputs=[q]) == [1.0]
        assert reward(["A"], [q["prompt"]], inputs=[q]) == [0.0]
    assert len({q["prompt"] for q in CHOICE_QUESTIONS}) == 8
