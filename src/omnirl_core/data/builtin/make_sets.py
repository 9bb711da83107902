"""Writes the built-in prompt sets (``builtin:NAME``) beside this file. Deterministic: rerunning it gives the
same files byte for byte (a test checks that the shipped files are what it writes).

    python src/omnirl_core/data/builtin/make_sets.py

Each line is a JSON record: ``prompt``, ``split`` (``train`` or ``test``; about a fifth held out) and the
fields a reward can check against. The words were written for omnirl; colour words are those the ``color``
reward knows, one per prompt (except ``composition``, which names two, the first being the main object).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_SHARE = 0.2

COLORS = ["red", "green", "blue", "yellow", "cyan", "magenta", "white", "black", "orange", "purple", "gray"]
OBJECTS = [
    "car", "bicycle", "umbrella", "chair", "teapot", "balloon", "kite", "boat", "house", "door", "cup", "vase",
    "hat", "shoe", "backpack", "lamp", "guitar", "bus", "truck", "train", "clock", "book", "pencil", "bottle",
    "bowl", "flower", "bird", "fish", "cat", "dog", "horse", "butterfly", "apple", "tulip", "sofa", "tent",
    "mailbox", "scarf", "cube", "sphere",
]
PLURAL = {"bus": "buses", "fish": "fish", "glass": "glasses", "butterfly": "butterflies", "box": "boxes",
          "sheep": "sheep", "mouse": "mice", "cherry": "cherries", "knife": "knives", "leaf": "leaves",
          "candle": "candles", "peach": "peaches", "bench": "benches", "dice": "dice"}
COLOR_TEMPLATES = ["a {color} {object}", "a photo of a {color} {object}", "a {color} {object} on a plain background"]

WORDS = [
    "OPEN", "CLOSED", "SALE", "HELLO", "CAFE", "BAKERY", "EXIT", "STOP", "WELCOME", "PIZZA", "BOOKS", "HOTEL",
    "TAXI", "MUSIC", "GARDEN", "PARK", "POST", "BANK", "PHARMACY", "MARKET", "DANGER", "QUIET", "LOVE", "DREAM",
    "COFFEE", "TEA", "SUSHI", "NOODLES", "TICKETS", "GATE 7", "ROOM 42", "NO PARKING", "FRESH BREAD",
    "THANK YOU", "GOOD LUCK", "HAPPY BIRTHDAY", "FLOWERS", "BARBER", "LIBRARY", "MUSEUM", "CINEMA", "ARCADE",
    "FERRY", "HARBOR", "BEACH", "SNOW", "RAIN", "SUN", "MOON", "STARS", "OMNI", "FLOW", "RL", "LAB", "ZOO",
    "FARM", "DINER", "GYM", "SPA", "JAZZ", "ROBOTS", "PAINT", "TOYS", "SHOES", "BIKES", "REPAIR", "LAUNDRY",
    "DELI", "ICE CREAM", "JUICE",
]
TEXT_TEMPLATES = [
    'a sign that says "{text}"', 'a storefront with the word "{text}"', 'a neon sign reading "{text}"',
    'a t-shirt printed with "{text}"', 'a book cover titled "{text}"', 'a chalkboard with "{text}" written on it',
]

NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
COUNT_OBJECTS = [
    "apple", "cat", "dog", "cup", "candle", "balloon", "book", "chair", "bird", "fish", "car", "boat", "star",
    "coin", "egg", "cookie", "lemon", "pear", "peach", "cherry", "leaf", "stone", "shell", "key", "spoon",
    "knife", "fork", "plate", "glass", "box", "dice", "mouse", "sheep", "duck", "frog", "owl", "tree", "house",
    "clock", "hat", "shoe", "bottle", "button", "feather", "pencil", "ring", "bench", "kite", "butterfly", "tulip",
]
COUNT_TEMPLATES = ["{number} {objects}", "a photo of {number} {objects}", "{number} {objects} on a table"]

RELATIONS = ["to the left of", "to the right of", "above", "below", "next to", "on top of", "in front of",
             "behind"]


def plural(word: str, n: int) -> str:
    if n == 1:
        return word
    return PLURAL.get(word, word + "s")


def articles(prompt: str) -> str:
    """'a orange cup' -> 'an orange cup' (every word here that starts with a vowel letter sounds like one)."""
    return re.sub(r"\ba ([aeiou])", r"an \1", prompt)


def _is_test(prompt: str) -> bool:
    """About TEST_SHARE of the prompts, by a hash of the text: stable whatever else the set holds."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < TEST_SHARE


def _with_split(records: list[dict]) -> list[dict]:
    seen: set[str] = set()
    out = []
    for record in records:
        record = {**record, "prompt": articles(record["prompt"])}
        if record["prompt"] in seen:
            continue
        seen.add(record["prompt"])
        out.append({"prompt": record["prompt"], "split": "test" if _is_test(record["prompt"]) else "train",
                    **{k: v for k, v in record.items() if k != "prompt"}})
    return out


def colors() -> list[dict]:
    rng = random.Random(1)
    return [{"prompt": rng.choice(COLOR_TEMPLATES).format(color=c, object=o), "color": c, "object": o}
            for c in COLORS for o in OBJECTS]


def text() -> list[dict]:
    rng = random.Random(2)
    out = []
    for word in WORDS:
        for template in rng.sample(TEXT_TEMPLATES, 4):
            out.append({"prompt": template.format(text=word), "text": word})
    return out


def counting() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt": rng.choice(COUNT_TEMPLATES).format(number=NUMBERS[n], objects=plural(o, n)),
             "count": n, "object": o} for n in NUMBERS for o in COUNT_OBJECTS]


def composition() -> list[dict]:
    rng = random.Random(4)
    out: list[dict] = []
    while len(out) < 320:
        c1, c2 = rng.sample(COLORS, 2)
        o1, o2 = rng.sample(OBJECTS, 2)
        relation = rng.choice(RELATIONS)
        out.append({"prompt": f"a {c1} {o1} {relation} a {c2} {o2}", "objects": [o1, o2], "colors": [c1, c2],
                    "relation": relation})
    return out


SETS = {"colors": colors, "text": text, "counting": counting, "composition": composition}


def render(name: str) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _with_split(SETS[name]()))


def main() -> None:
    for name in SETS:
        (HERE / f"{name}.jsonl").write_text(render(name), encoding="utf-8")


if __name__ == "__main__":
    main()
