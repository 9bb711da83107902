"""Options of the ``vlm-judge`` reward and its built-in prompt templates.

Secrets never come from the config: the API key is read from an environment variable whose name must match
``OMNIRL_*_API_KEY`` or ``OMNIRL_*_TOKEN``, and a URL with credentials in it is refused. Validation errors
never echo a URL's credentials or a value given as ``api_key_env`` (omnirl prints each error's input).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
)

from omnirl_plugin_vlm_judge.redaction import display_url

# Only a variable made for omnirl may hold the key: a recipe must not be able to send the user's other
# credentials (AWS_SESSION_TOKEN, HF_TOKEN, OPENAI_API_KEY, ...) to a URL the recipe chooses.
KEY_ENV_RULE = re.compile(r"OMNIRL_(?:[A-Z0-9]+_)*(?:API_KEY|TOKEN)")


@dataclass(frozen=True)
class Template:
    text: str
    parse: str
    score_range: tuple[float, float] | None = None
    score_prefix: str = ""
    source: bool = False
    """The judge sees the prompt's source image (an edit's) before the sample."""


TEMPLATES = {
    "pointwise": Template(
        "You are an expert judge of generated images. The image was generated from this prompt:\n"
        "{prompt}\n"
        "Rate how faithfully the image follows the prompt and how good it looks (composition, detail, no "
        "artifacts) on a scale from 0 (unrelated or broken) to 10 (perfect). Reply with the number only.",
        parse="number", score_range=(0.0, 10.0)),
    "unifiedreward": Template(
        "You are given an image generated from a text prompt. Judge it in three parts, one short sentence "
        "each:\n"
        "1. Alignment: does the image show everything the prompt asks for, and nothing that contradicts it?\n"
        "2. Coherence: are objects, anatomy, text and lighting plausible and free of artifacts?\n"
        "3. Style: is the image aesthetically pleasing and consistent with any style the prompt names?\n"
        "Then give one overall rating from 1 (poor) to 5 (excellent) on the last line, exactly in the form\n"
        "Final Score: <1-5>\n"
        "Prompt: {prompt}",
        parse="number", score_range=(1.0, 5.0), score_prefix="Final Score:"),
    "yes-no": Template(
        "The image was generated from this prompt:\n{prompt}\n"
        "Does the image match the prompt, with good quality? Answer with one word: yes or no.",
        parse="yes-logprob"),
    "json": Template(
        "You are an expert judge of generated images. The image was generated from this prompt:\n"
        "{prompt}\n"
        "Rate how faithfully the image follows the prompt and how good it looks, from 0 (unrelated or "
        'broken) to 10 (perfect). Reply with a JSON object only: {"score": <number from 0 to 10>, '
        '"reason": "<one sentence>"}',
        parse="json", score_range=(0.0, 10.0)),
    "edit": Template(
        "You are an expert judge of image edits. The first image is the source; the second is the result of "
        "editing it with this instruction:\n"
        "{prompt}\n"
        "Rate the result from 0 to 10: how completely it carries out the instruction, and how well it keeps "
        "everything the instruction does not ask to change (layout, objects, colours, background, identity). "
        "10: the instruction is carried out exactly and nothing else changed; 0: the instruction is ignored or the "
        "image is unrelated or broken. Reply with the number only.",
        parse="number", score_range=(0.0, 10.0), source=True),
}
AUTO_TEMPLATE = {"number": "pointwise", "yes-logprob": "yes-no", "json": "json"}


class _RedactedURL(str):
    """A URL whose repr hides credentials: pydantic and omnirl echo a field's input in validation errors."""

    def __repr__(self) -> str:
        return repr(display_url(str(self)))


class _Hidden(str):
    """A value never shown in an error (someone may paste the key itself into ``api_key_env``)."""

    def __repr__(self) -> str:
        return "'<hidden>'"


def _wrap(cls: type[str]):
    return lambda value: cls(value) if isinstance(value, str) else value


def _check_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on an invalid port
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("url must start with http:// or https://")
    if not parts.hostname:
        raise ValueError("url has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not hold credentials (user:password@); put the API key in the "
                         "environment variable named by api_key_env")
    return _RedactedURL(value)


def _check_key_env(value: str) -> str:
    if not KEY_ENV_RULE.fullmatch(value):
        raise ValueError("api_key_env must name an environment variable matching OMNIRL_*_API_KEY or "
                         "OMNIRL_*_TOKEN (upper case), e.g. OMNIRL_JUDGE_API_KEY; copy your key into such a "
                         "variable (export OMNIRL_JUDGE_API_KEY=...). Never put the key itself in the config")
    return str(value)


# After-validators listed before the before-validator: the check then sees (and an error then echoes) the
# wrapped value, whose repr shows no secret.
URL = Annotated[str, AfterValidator(_check_url), BeforeValidator(_wrap(_RedactedURL))]
KeyEnv = Annotated[str, AfterValidator(_check_key_env), BeforeValidator(_wrap(_Hidden))]


class VLMJudgeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: URL = Field("http://127.0.0.1:8000/v1", description="The server's OpenAI-compatible base URL (…/v1), "
                     "or the full …/chat/completions endpoint. http or https, no credentials in it.")
    model: str = Field("Qwen/Qwen2.5-VL-7B-Instruct", min_length=1,
                       description="Model name the server serves (vLLM: the name given to `vllm serve` or "
                       "--served-model-name).")
    api_key_env: KeyEnv = Field("OMNIRL_JUDGE_API_KEY", description="Environment variable holding the API key, "
                                "sent as a Bearer token (unset or empty: no key). The name must match "
                                "OMNIRL_*_API_KEY or OMNIRL_*_TOKEN; a literal key is never accepted.")
    parse: Literal["number", "yes-logprob", "json"] = Field(
        "number", description="How the score is read: number (first number in the reply, after score_prefix), "
        "yes-logprob (P(yes)/(P(yes)+P(no)) from the first token's top log-probs), json (the score_field "
        "of a JSON object in the reply).")
    prompt_template: str = Field(
        "auto", description="The question sent with each image: a built-in (pointwise, unifiedreward, yes-no, "
        "json, edit; auto: pointwise, yes-no or json after parse) or your own text with {prompt} in it. edit: "
        "the source image, then the result, judged on instruction-following and preservation.")
    source_image: bool | None = Field(
        None, description="Send the prompt's source image (its record's 'image', an edit's) before the sample. "
        "Unset: the template's (edit: yes; the others: no).")
    score_range: tuple[float, float] | None = Field(
        None, description="The judge's scale as (low, high), mapped to [0, 1]; a score outside it is an error. "
        "Unset: the built-in template's range (pointwise, json: [0, 10]; unifiedreward: [1, 5]), none for "
        "your own template. Not used by yes-logprob.")
    score_prefix: str | None = Field(
        None, description="parse=number: read the first number after the last occurrence of this text (case "
        "does not matter). Unset: the template's ('Final Score:' for unifiedreward, else none).")
    score_field: str = Field("score", min_length=1, description="parse=json: the field holding the score.")
    top_logprobs: int = Field(5, ge=1, le=20, description="parse=yes-logprob: how many top log-probs to ask for "
                              "(vLLM caps it with --max-logprobs, default 20).")
    max_tokens: int = Field(256, ge=1, description="Most tokens the judge may reply with (parse=yes-logprob "
                            "always sends 1: only the first token is read).")
    concurrency: int = Field(8, ge=1, le=256, description="Requests in flight at once, per judge instance (one "
                             "per process, or per Ray reward actor); also the size of its connection pool.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Wall-clock deadline of one request: connecting, "
                             "sending and reading the whole reply. Not retried.")
    retries: int = Field(2, ge=0, le=10, description="Retries of a connection error, HTTP 429 or 5xx, with "
                         "exponential backoff.")
    backoff_s: float = Field(0.5, ge=0, le=60, description="Wait before the first retry; doubles on each "
                             "(at most 30 s; a Retry-After header up to 30 s is honoured).")
    max_response_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="Largest reply body read; a "
                                    "larger one is an error and is not read further.")
    image_format: Literal["png", "jpeg"] = Field(
        "png", description="How each image is sent: png (lossless: the judge sees the sample's pixels) or jpeg "
        "(lossy; at quality 95 a 1024 px image encodes in under 10 ms where PNG takes over 100 ms of the "
        "trainer's CPU, and is 2.5-5x smaller; benchmarks/image_encoding.py).")
    jpeg_quality: int = Field(95, ge=1, le=100, description="image_format=jpeg: the JPEG quality (1-100).")

    @field_validator("prompt_template")
    @classmethod
    def _known_template(cls, value: str, info: ValidationInfo) -> str:
        parse = info.data.get("parse")
        if value == "auto" or parse is None:
            return value
        if value in TEMPLATES:
            if TEMPLATES[value].parse != parse:
                raise ValueError(f"the built-in template '{value}' is written for parse={TEMPLATES[value].parse}, "
                                 f"not parse={parse}")
            return value
        if "{prompt}" not in value:
            raise ValueError(f"must be one of {', '.join(['auto', *TEMPLATES])} or a text containing {{prompt}}")
        return value

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not (math.isfinite(value[0]) and math.isfinite(value[1]) and value[0] < value[1]):
            raise ValueError("score_range must be two finite numbers [low, high] with low < high")
        return value

    @field_validator("score_prefix")
    @classmethod
    def _number_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("parse", "number") != "number":
            raise ValueError("score_prefix applies to parse=number only")
        return value

    @field_serializer("url")
    def _no_credentials(self, value: str) -> str:  # defence in depth: they are refused above
        return display_url(value)

    def __repr_args__(self):
        for name, value in super().__repr_args__():
            yield name, (display_url(value) if name == "url" else value)

    # -- what the judge uses ------------------------------------------------------------------
    def template(self) -> Template:
        name = AUTO_TEMPLATE[self.parse] if self.prompt_template == "auto" else self.prompt_template
        base = TEMPLATES.get(name) or Template(name, parse=self.parse)
        return Template(
            base.text, base.parse,
            score_range=self.score_range if self.score_range is not None else base.score_range,
            score_prefix=self.score_prefix if self.score_prefix is not None else base.score_prefix,
            source=self.source_image if self.source_image is not None else base.source,
        )


def input_fields(options: VLMJudgeOptions | None) -> tuple[str, ...]:
    """The prompt-record fields the judge reads: the source image when it sends one (checked at dry-run)."""
    return ("image",) if (options or VLMJudgeOptions()).template().source else ()
