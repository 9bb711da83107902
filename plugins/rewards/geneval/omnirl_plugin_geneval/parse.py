"""What a GenEval prompt asks for: its metadata record, or the prompt text read with GenEval's templates.

A GenEval metadata record (``evaluation_metadata.jsonl``)::

    {"tag": "position", "prompt": "a photo of a dog right of a cat",
     "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
     "exclude": [{"class": "dog", "count": 2}]}

``include``: each class must be present at least ``count`` times; with ``color``, that many of them in that
colour; with ``position: [relation, i]``, every one of them must stand in that relation to every object found
for ``include[i]``. ``exclude``: fewer than ``count`` of the class. Plain prompts are read with the templates
GenEval generates its prompts from ("a photo of a red cat", "a photo of three cats", "a photo of a cat and a
dog", "a photo of a dog right of a cat", "a photo of a red cat and a blue dog").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
           "ten": 10}
# The 80 COCO classes GenEval's prompts are made of
COCO = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
_IRREGULAR = {"people": "person", "mice": "mouse", "knives": "knife", "skis": "skis", "benches": "bench",
              "sandwiches": "sandwich", "buses": "bus", "couches": "couch", "toothbrushes": "toothbrush",
              "wine glasses": "wine glass", "dining tables": "dining table", "sheep": "sheep",
              "scissors": "scissors", "computer mice": "computer mouse", "hair driers": "hair drier"}


@dataclass(frozen=True)
class Want:
    cls: str
    count: int = 1
    color: str | None = None
    position: tuple[str, int] | None = None


@dataclass(frozen=True)
class Task:
    include: tuple[Want, ...]
    exclude: tuple[Want, ...] = ()
    tag: str = ""

    @property
    def classes(self) -> list[str]:
        return list(dict.fromkeys([w.cls for w in self.include] + [w.cls for w in self.exclude]))


class PromptError(ValueError):
    pass


def _want(item: Any, where: str) -> Want:
    if not isinstance(item, dict) or not isinstance(item.get("class"), str):
        raise PromptError(f"{where}: expected {{'class': NAME, 'count': N, ...}}, got {item!r}")
    position = item.get("position")
    if position is not None:
        if (not isinstance(position, (list, tuple)) or len(position) != 2 or position[0] not in RELATIONS
                or not isinstance(position[1], int)):
            raise PromptError(f"{where}.position: expected [one of {list(RELATIONS)}, INDEX], got {position!r}")
        position = (position[0], position[1])
    color = item.get("color")
    if color is not None and color not in COLORS:
        raise PromptError(f"{where}.color: {color!r} is not one of GenEval's colours {list(COLORS)}")
    return Want(item["class"], int(item.get("count", 1)), color, position)


def from_metadata(record: dict[str, Any]) -> Task:
    include = tuple(_want(x, f"include[{i}]") for i, x in enumerate(record.get("include") or []))
    exclude = tuple(_want(x, f"exclude[{i}]") for i, x in enumerate(record.get("exclude") or []))
    if not include:
        raise PromptError("the record's 'include' is empty")
    for i, want in enumerate(include):
        if want.position is not None and not 0 <= want.position[1] < len(include):
            raise PromptError(f"include[{i}].position refers to include[{want.position[1]}], which does not exist")
    return Task(include, exclude, str(record.get("tag", "")))


def singular(noun: str) -> str | None:
    """A COCO class from a (possibly plural) noun phrase, or None."""
    noun = noun.strip().lower()
    if noun in COCO:
        return noun
    if noun in _IRREGULAR:
        return _IRREGULAR[noun]
    for cut in ("es", "s"):
        if noun.endswith(cut) and noun[: -len(cut)] in COCO:
            return noun[: -len(cut)]
    return None


_ART = r"(?:an?|the|one)"
_OBJ = r"([a-z][a-z ]*?)"
_COLOR = "(" + "|".join(COLORS) + ")"
_REL = "(" + "|".join(RELATIONS) + ")"
_PREFIX = r"^(?:a photo of|an image of|a picture of)?\s*"


def from_prompt(prompt: str) -> Task:
    """A GenEval-template prompt -> Task; PromptError when it does not follow one of the templates."""
    text = re.sub(r"\s+", " ", prompt.strip().lower().rstrip("."))

    def cls(noun: str) -> str:
        found = singular(noun)
        if found is None:
            raise PromptError(f"'{noun}' in {prompt!r} is not a COCO class (GenEval's objects)")
        return found

    if m := re.fullmatch(_PREFIX + rf"{_ART} {_COLOR} {_OBJ} and {_ART} {_COLOR} {_OBJ}", text):
        return Task((Want(cls(m[2]), 1, m[1]), Want(cls(m[4]), 1, m[3])), tag="color_attr")
    if m := re.fullmatch(_PREFIX + rf"{_ART} {_OBJ} {_REL} {_ART} {_OBJ}", text):
        return Task((Want(cls(m[3])), Want(cls(m[1]), 1, None, (m[2], 0))), tag="position")
    if m := re.fullmatch(_PREFIX + rf"{_ART} {_OBJ} and {_ART} {_OBJ}", text):
        return Task((Want(cls(m[1])), Want(cls(m[2]))), tag="two_object")
    if m := re.fullmatch(_PREFIX + "(" + "|".join(NUMBERS) + rf") {_OBJ}", text):
        n, obj = NUMBERS[m[1]], cls(m[2])
        return Task((Want(obj, n),), (Want(obj, n + 1),), tag="counting")
    if m := re.fullmatch(_PREFIX + rf"{_ART} {_COLOR} {_OBJ}", text):
        return Task((Want(cls(m[2]), 1, m[1]),), tag="colors")
    if m := re.fullmatch(_PREFIX + rf"{_ART} {_OBJ}", text):
        return Task((Want(cls(m[1])),), tag="single_object")
    raise PromptError(f"{prompt!r} follows none of GenEval's templates (a photo of a [COLOR] OBJ, NUMBER OBJS, "
                      "OBJ and OBJ, OBJ left of/right of/above/below OBJ, COLOR OBJ and COLOR OBJ)")


def task_of(prompt: str, record: Any) -> Task:
    """The record's metadata when it has ``include``, else the prompt read with the templates."""
    if isinstance(record, dict) and record.get("include"):
        return from_metadata(record)
    return from_prompt(prompt)
