"""Writes the built-in prompt sets (``builtin:NAME``) beside this file. Deterministic: rerunning it gives the
same files byte for byte (a test checks that the shipped files are what it writes).

    python src/omnirl_core/data/builtin/make_sets.py

Each line is a JSON record: ``prompt``, ``split`` (``train`` or ``test``; about a fifth held out) and the
fields a reward can check against. The words were written for omnirl; colour words are those the ``color``
reward knows, one per prompt (except ``composition``, which names two, the first being the main object).

``edits`` is an editing set: each instruction ("make the square on the left red") comes with a small generated
source picture (``image``: a shape of another colour on a neutral background, ``edits/NNNN.png``) and the mask of
the region the edit may change (``mask``: the shape, a little dilated); the instruction names only the target
colour (``color``), so a colour reward can read it from the text.

``speech`` is a set of texts to speak (text to speech: the prompt is what is said): short sentences with numbers
(counts, times, dates, years, ordinals, percentages), names and places, and punctuation (questions, exclamations,
commas, abbreviations), 15 - 29 letters and digits each (1.2 - 2.4 s at 12 a second; ``kind``: the template).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Any

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


EDIT_SIZE = 64
"""Side of the edit set's source pictures, in pixels."""
EDIT_SHAPES = ["square", "circle", "triangle", "diamond"]
EDIT_COLORS = ["red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple"]
EDIT_BACKGROUNDS = ["white", "black", "gray"]
EDIT_POSITIONS = {"on the left": (0.3, 0.5), "on the right": (0.7, 0.5), "at the top": (0.5, 0.3),
                  "at the bottom": (0.5, 0.7), "in the middle": (0.5, 0.5)}
EDIT_TEMPLATES = ["make the {shape} {position} {color}", "turn the {shape} {position} {color}",
                  "paint the {shape} {position} {color}", "change the {shape} {position} to {color}"]
RGB = {"red": (230, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 230), "yellow": (240, 220, 30),
       "cyan": (30, 210, 220), "magenta": (220, 40, 210), "orange": (245, 140, 20), "purple": (130, 40, 160),
       "white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128)}


def edits() -> list[dict]:
    rng = random.Random(5)
    out: list[dict] = []
    for shape in EDIT_SHAPES:
        for position, (cx, cy) in EDIT_POSITIONS.items():
            for color in EDIT_COLORS:
                for template in rng.sample(EDIT_TEMPLATES, 2):
                    half = rng.randint(8, 12)
                    x, y = round(cx * EDIT_SIZE) + rng.randint(-2, 2), round(cy * EDIT_SIZE) + rng.randint(-2, 2)
                    n = len(out)
                    out.append({"prompt": template.format(shape=shape, position=position, color=color),
                                "image": f"edits/{n:04d}.png", "mask": f"edits/{n:04d}-mask.png", "color": color,
                                "object": shape, "position": position,
                                "source_color": rng.choice([c for c in EDIT_COLORS if c != color]),
                                "background": rng.choice(EDIT_BACKGROUNDS),
                                "box": [x - half, y - half, x + half, y + half]})
    return out


def square_pictures(folder: Path, size: int) -> list[str]:
    """One picture per colour of the edits set, ``size`` px: that colour as the background with a square of another
    in it (PNG files written into ``folder``; their paths). Sources other than the set's own pictures, e.g. for
    checking that a model's encoder tells sources apart."""
    from PIL import Image

    colours = list(RGB.values())
    paths = []
    for k, background in enumerate(colours):
        image = Image.new("RGB", (size, size), background)
        image.paste(colours[(k + 3) % len(colours)], (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
        paths.append(str(folder / f"{k}.png"))
        image.save(paths[-1])
    return paths


def draw_edit(record: dict) -> tuple[Any, Any]:
    """The source picture (RGB) and the edit mask (L: 255 where the edit may change pixels) of an ``edits`` record."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (EDIT_SIZE, EDIT_SIZE), RGB[record["background"]])
    mask = Image.new("L", (EDIT_SIZE, EDIT_SIZE), 0)
    x0, y0, x1, y1 = record["box"]
    for canvas, fill, grow in ((ImageDraw.Draw(image), RGB[record["source_color"]], 0), (ImageDraw.Draw(mask), 255, 2)):
        box = [x0 - grow, y0 - grow, x1 + grow, y1 + grow]
        if record["object"] == "square":
            canvas.rectangle(box, fill=fill)
        elif record["object"] == "circle":
            canvas.ellipse(box, fill=fill)
        elif record["object"] == "triangle":
            canvas.polygon([((box[0] + box[2]) / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
        else:  # diamond
            mx, my = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            canvas.polygon([(mx, box[1]), (box[2], my), (mx, box[3]), (box[0], my)], fill=fill)
    return image, mask


FIRST_NAMES = [
    "Anna", "Ben", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Maya",
    "Noah", "Olga", "Priya", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe",
]
SURNAMES = ["Brown", "Smith", "Lee", "Garcia", "Okafor", "Novak", "Tanaka", "Silva", "Khan", "Meyer"]
TITLES = ["Mr.", "Ms.", "Dr."]
PLACES = ["Paris", "Lisbon", "Cairo", "Oslo", "Tokyo", "Lima", "Nairobi", "Seoul", "Berlin", "Toronto", "Dublin",
          "Quito"]
ITEMS = ["apples", "tickets", "books", "chairs", "eggs", "lemons", "cups", "pens", "maps", "stamps"]
MONTHS = ["January", "March", "April", "May", "June", "July", "August", "October"]
DAYS = ["Monday", "Tuesday", "Friday", "Sunday"]
ORDINAL_WORDS = {1: "1st", 2: "2nd", 3: "3rd", 4: "4th", 5: "5th", 6: "6th", 7: "7th", 8: "8th", 9: "9th"}
SPEECH_TEMPLATES: dict[str, Any] = {
    "greeting": lambda r: f"Hello, my name is {r.choice(FIRST_NAMES)}.",
    "count": lambda r: f"{r.choice(FIRST_NAMES)} bought {r.randint(2, 40)} {r.choice(ITEMS)}.",
    "time": lambda r: f"The train to {r.choice(PLACES)} leaves at {r.randint(1, 12)}:{r.choice(range(5, 60, 5)):02d}.",
    "date": lambda r: f"{r.choice(FIRST_NAMES)} was born on {r.choice(MONTHS)} {r.randint(1, 28)}, {r.randint(1950, 2019)}.",
    "question": lambda r: f"Is {r.choice(FIRST_NAMES)} in {r.choice(PLACES)} on {r.choice(DAYS)}?",
    "sum": lambda r: f"How much is {r.randint(2, 19)} plus {r.randint(2, 19)}?",
    "title": lambda r: f"Good morning, {r.choice(TITLES)} {r.choice(SURNAMES)}!",
    "floor": lambda r: f"Room {r.randint(10, 99)} is on the {ORDINAL_WORDS[r.randint(1, 9)]} floor.",
    "percent": lambda r: f"About {r.choice(range(10, 100, 5))}% of us voted yes.",
    "distance": lambda r: f"We walked {r.randint(2, 30)} miles to {r.choice(PLACES)}.",
    "score": lambda r: f"The score was {r.randint(0, 9)} to {r.randint(0, 9)}, {r.choice(FIRST_NAMES)}!",
    "gate": lambda r: f"Please go to gate {r.randint(1, 60)}, {r.choice(TITLES)} {r.choice(SURNAMES)}.",
}
SPEECH_PER_TEMPLATE = 26


def speech() -> list[dict]:
    rng = random.Random(6)
    out: list[dict] = []
    for _ in range(SPEECH_PER_TEMPLATE):  # the kinds interleaved: the first prompts of either split mix them
        for kind, template in SPEECH_TEMPLATES.items():
            out.append({"prompt": template(rng), "kind": kind})
    return out


SETS = {"colors": colors, "text": text, "counting": counting, "composition": composition, "edits": edits,
        "speech": speech}


def render(name: str) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _with_split(SETS[name]()))


def write_edit_images(folder: Path) -> None:
    """The ``edits`` set's pictures and masks (PNG) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for record in edits():
        image, mask = draw_edit(record)
        image.save(folder.parent / record["image"], optimize=True)
        mask.save(folder.parent / record["mask"], optimize=True)


def main() -> None:
    for name in SETS:
        (HERE / f"{name}.jsonl").write_text(render(name), encoding="utf-8")
    write_edit_images(HERE / "edits")


if __name__ == "__main__":
    main()
