"""Keeping secrets out of messages: the API key, and credentials inside URLs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from urllib.parse import quote, urlsplit

MASK = "**********"
# scheme://user:password@ -> scheme://***@ (anywhere in a text: a server may quote URLs back)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@")


def strip_url_credentials(text: str) -> str:
    return _USERINFO.sub(r"\1***@", text)


def display_url(url: str) -> str:
    """``url`` safe to show: credentials replaced by ``***``."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on an invalid port
    except ValueError:
        return strip_url_credentials(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{'[' + host + ']' if ':' in host else host}{f':{parts.port}' if parts.port else ''}"
    return parts._replace(netloc=netloc).geturl()


class Redactor:
    """Replaces every secret (also JSON-escaped or percent-encoded, as a server may echo it) by a mask, and
    credentials inside URLs by ``***``."""

    def __init__(self, secrets: Iterable[str] = ()):
        forms: set[str] = set()
        for secret in secrets:
            if secret:
                forms |= {secret, json.dumps(secret)[1:-1], quote(secret, safe="")}
        self._forms = sorted(forms, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for form in self._forms:
            text = text.replace(form, MASK)
        return strip_url_credentials(text)
