"""From a chat-completions reply to a score. Every malformed reply is an error, never a silent number: a
score must be a real, finite JSON number (not a bool, not a string), inside the declared range."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from omnirl_plugin_vlm_judge.options import Template

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
YES, NO = "yes", "no"


class JudgeError(RuntimeError):
    """The judge gave no usable score. The message is one line and holds no secret."""


class ReplyError(ValueError):
    """What is wrong with a reply (the caller adds which server and how to fix it)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(data: bytes | str) -> Any:
    """Strict JSON: NaN and Infinity are refused."""
    return json.loads(data, parse_constant=_reject_constant)


def real_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"{what} is {type(value).__name__} {str(value)[:40]!r}, not a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ReplyError(f"{what} is not finite ({number})")
    return number


def normalise(value: float, score_range: tuple[float, float] | None) -> float:
    if score_range is None:
        return value
    low, high = score_range
    if not low <= value <= high:
        raise ReplyError(f"score {value:g} is outside score_range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def first_choice(reply: Any) -> dict[str, Any]:
    if not isinstance(reply, dict):
        raise ReplyError(f"the reply is a JSON {type(reply).__name__}, not an object")
    choices = reply.get("choices")
    if not isinstance(choices, list):
        error = reply.get("error")
        raise ReplyError(f"the reply has no 'choices' list{f' (error: {str(error)[:200]})' if error else ''}")
    if len(choices) != 1:
        raise ReplyError(f"expected 1 choice, got {len(choices)}")
    if not isinstance(choices[0], dict):
        raise ReplyError("choices[0] is not an object")
    return choices[0]


def reply_text(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise ReplyError("choices[0].message.content is missing or not text")
    return content


def parse_number(text: str, template: Template) -> float:
    if template.score_prefix:
        at = text.lower().rfind(template.score_prefix.lower())
        if at < 0:
            raise ReplyError(f"no '{template.score_prefix}' in the reply")
        text = text[at + len(template.score_prefix):]
    match = NUMBER.search(text)
    if match is None:
        raise ReplyError("no number in the reply")
    return normalise(real_number(float(match.group()), "the score"), template.score_range)


def parse_json(text: str, field: str, template: Template) -> float:
    body = text.strip()
    if body.startswith("```"):  # a fenced block: ```json ... ```
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        obj = loads(body)
    except ValueError:
        start, end = body.find("{"), body.rfind("}")
        try:
            obj = loads(body[start:end + 1]) if 0 <= start < end else None
        except ValueError as exc:
            raise ReplyError(f"the reply holds no valid JSON object ({exc})") from None
    if not isinstance(obj, dict):
        raise ReplyError("the reply holds no JSON object")
    if field not in obj:
        raise ReplyError(f"the reply's JSON object has no '{field}' field (fields: {', '.join(list(obj)[:10])})")
    return normalise(real_number(obj[field], f"'{field}'"), template.score_range)


def parse_yes_logprob(choice: dict[str, Any]) -> float:
    """P(yes) / (P(yes) + P(no)) over the first generated token's top log-probs (tokens compared after
    stripping spaces, case ignored)."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        raise ReplyError("the reply has no choices[0].logprobs.content (does the server support logprobs?)")
    first = content[0]
    tops = first.get("top_logprobs")
    if not isinstance(tops, list):
        raise ReplyError("the first token has no top_logprobs list")
    seen: dict[str, float] = {}  # token text -> log-prob; the sampled token is usually among the top ones
    for entry in [first, *tops]:
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise ReplyError("a top_logprobs entry has no 'token' text")
        logprob = real_number(entry.get("logprob"), f"the log-prob of {entry['token'][:20]!r}")
        if logprob > 1e-6:
            raise ReplyError(f"the log-prob of {entry['token'][:20]!r} is positive ({logprob:g})")
        seen[entry["token"]] = logprob
    p_yes = sum(math.exp(lp) for token, lp in seen.items() if token.strip().lower() == YES)
    p_no = sum(math.exp(lp) for token, lp in seen.items() if token.strip().lower() == NO)
    if p_yes + p_no <= 0.0:
        shown = ", ".join(repr(t) for t in list(seen)[:8])
        raise ReplyError(f"neither 'yes' nor 'no' among the first token's top log-probs ({shown})")
    return p_yes / (p_yes + p_no)


def parse_score(reply: Any, parse: str, template: Template, score_field: str = "score") -> float:
    """The score in ``reply`` (a decoded chat-completions response); raises ReplyError."""
    choice = first_choice(reply)
    if parse == "yes-logprob":
        return parse_yes_logprob(choice)
    text = reply_text(choice)
    try:
        if parse == "json":
            return parse_json(text, score_field, template)
        return parse_number(text, template)
    except ReplyError as exc:
        cut = " (the reply was cut at max_tokens)" if choice.get("finish_reason") == "length" else ""
        raise ReplyError(f"{exc}{cut}; the reply: {text[:200]!r}") from None
