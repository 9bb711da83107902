"""Text normalisation and error rates for comparing a transcript with the text that was spoken.

``normalise``: Unicode NFKC, lower case; numbers spelt as English words (digits to words, never the reverse:
"23", "twenty-three" and "Twenty three" all become "twenty three"; "1,000" -> "one thousand", "3.5" -> "three
point five", "21st" -> "twenty first", "50%" -> "fifty percent", "7:45" -> "seven forty five"); apostrophes
dropped inside words ("don't" -> "dont"); every other punctuation mark or symbol a space; white space collapsed.
Years are read as cardinals ("1990" -> "one thousand nine hundred ninety") on both sides, so they match each
other but not a reference that spells "nineteen ninety".

``cer`` / ``wer``: Levenshtein distance (substitutions + deletions + insertions, each costing 1) over characters
(spaces included) or words, divided by the reference's length.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
            "twelve": "twelfth"}


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_TENS[n // 10])
        n %= 10
        if n:
            words.append(_ONES[n])
    elif n or not words:
        words.append(_ONES[n])
    return words


def cardinal(n: int) -> str:
    """A non-negative integer in English words without "and" or hyphens ("one hundred twenty three"); beyond
    the trillions, digit by digit."""
    if n >= 10**15:
        return " ".join(_ONES[int(d)] for d in str(n))
    if n < 1000:
        return " ".join(_below_thousand(n))
    words = []
    for scale, name in _SCALES:
        if n >= scale:
            words += _below_thousand(n // scale) + [name]
            n %= scale
    if n:
        words += _below_thousand(n)
    return " ".join(words)


def ordinal(n: int) -> str:
    words = cardinal(n).split()
    last = words[-1]
    words[-1] = _ORDINAL.get(last) or (last[:-1] + "ieth" if last.endswith("y") else last + "th")
    return " ".join(words)


_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NUMBER = re.compile(r"(\d+)(?:\.(\d+))?(st|nd|rd|th)?")


def _spell(match: re.Match[str]) -> str:
    whole, fraction, suffix = match.group(1), match.group(2), match.group(3)
    if suffix and not fraction:
        return f" {ordinal(int(whole))} "
    words = cardinal(int(whole))
    if fraction:
        words += " point " + " ".join(_ONES[int(d)] for d in fraction)
        if suffix:
            words += " " + suffix
    return f" {words} "


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = _THOUSANDS_COMMA.sub("", text)
    text = text.replace("%", " percent ").replace("&", " and ")
    text = _NUMBER.sub(_spell, text)
    text = re.sub(r"(?<=\w)['\u2019](?=\w)", "", text)
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return " ".join(text.split())


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Levenshtein distance: the fewest substitutions, deletions and insertions turning ``ref`` into ``hyp``."""
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def normalised_reference(text: str) -> str:
    """The spoken text normalised; an error when nothing is left (no rate is defined against an empty text)."""
    ref = normalise(text)
    if not ref:
        raise ValueError(f"the spoken text {text!r} has nothing to transcribe once normalised (no letters or "
                         "digits): an error rate needs a reference with words")
    return ref


def error_rate(reference: str, hypothesis: str, unit: str) -> float:
    """CER (``unit="char"``) or WER (``"word"``) of ``hypothesis`` against ``reference``, both normalised."""
    ref, hyp = normalised_reference(reference), normalise(hypothesis)
    if unit == "word":
        return edit_distance(ref.split(), hyp.split()) / len(ref.split())
    return edit_distance(ref, hyp) / len(ref)
