"""Rule reward for question-answer data: 1.0 when the answer extracted from the model's text equals the
reference answer in the prompt's data record (``answer`` by default), else 0.0.

Extraction modes:
- ``choice``: a choice letter the text starts with ("B", "(B)", "B. blue") or states ("The answer is B");
- ``number``: the last number in the text, compared numerically ("... so 1,250 apples" -> 1250);
- ``boxed``: the content of the last ``\\boxed{...}``;
- ``exact``: the whole text, whitespace collapsed.
A text with no extractable answer scores 0. A record without a reference answer is an error, never a 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirl_core.contracts import Reward


class AnswerMatchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    extract: Literal["choice", "number", "boxed", "exact"] = Field(
        "choice", description="How the answer is read from the text: choice letter, last number, \\boxed{}, or "
        "the whole text."
    )
    answer_key: str = Field("answer", description="Field of the prompt record that holds the reference answer.")
    choices: str = Field("ABCD", min_length=1, description="The choice letters (choice mode).")
    case_sensitive: bool = Field(False, description="Compare case-sensitively (exact and boxed modes).")


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def input_fields(options: AnswerMatchOptions | None) -> tuple[str, ...]:
    """The prompt-record field the reward compares against (checked at dry-run)."""
    return ((options or AnswerMatchOptions()).answer_key,)


def extract_choice(text: str, choices: str) -> str | None:
    letters = re.escape(choices)
    # the text opens with the letter: "B", "(B)", "B) blue", "B." -- but not "Because" or "CA"
    head = re.match(rf"\s*\(?([{letters}])(?![A-Za-z0-9])", text)
    if head:
        return head.group(1)
    stated = re.findall(rf"(?i:answer)(?:\s+is)?\s*[:=]?\s*\(?([{letters}])(?![A-Za-z0-9])", text)
    return stated[-1] if stated else None


def extract_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    for raw in reversed(found):
        try:
            return float(raw.replace(",", ""))
        except ValueError:
            continue
    return None


def extract_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def _normalise(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


class AnswerMatch(Reward):
    uses_inputs = True  # called with each prompt's record (the reference answer)
    batch_invariant = True  # each text scored on its own: batching what piles up changes no score

    def __init__(self, options: AnswerMatchOptions | None = None):
        self.options = options or AnswerMatchOptions()

    def reference(self, record: dict[str, Any], prompt: str) -> Any:
        key = self.options.answer_key
        if key not in record or record[key] is None:
            raise ValueError(
                f"the prompt {prompt[:60]!r} has no reference answer in its record field '{key}': give prompts as a "
                f".jsonl of {{\"prompt\": ..., \"{key}\": ...}} records (data.prompts)"
            )
        return record[key]

    def score(self, text: str, answer: Any) -> float:
        o = self.options
        if o.extract == "choice":
            expected = extract_choice(str(answer), o.choices)
            if expected is None:
                raise ValueError(f"reference answer {answer!r} is not one of the choices {o.choices!r}")
            return float(extract_choice(text, o.choices) == expected)
        if o.extract == "number":
            got, expected = extract_number(text), float(answer)
            return float(got is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9))
        if o.extract == "boxed":
            got = extract_boxed(text)
            return float(got is not None and _normalise(got, o.case_sensitive) == _normalise(str(answer),
                                                                                          o.case_sensitive))
        return float(_normalise(text, o.case_sensitive) == _normalise(str(answer), o.case_sensitive))

    def __call__(self, outputs: Sequence[Any], prompts: Sequence[str],
                 inputs: Sequence[dict[str, Any]] | None = None) -> list[float]:
        if inputs is None:
            raise ValueError("answer-match needs each prompt's record (inputs=...) for the reference answer")
        return [self.score(str(text), self.reference(record, prompt))
                for text, prompt, record in zip(outputs, prompts, inputs)]
