"""Keeping secrets out of messages: the API key, and credentials inside URLs."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

MASK = "**********"
# scheme://user:password@ -> scheme://***@ (anywhere in a text: a server may quote URLs back)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@")
_JSON_SHORT = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_URLSAFE = str.maketrans("+/", "-_")


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


def _hex(value: int, width: int) -> str:
    """``value`` in hexadecimal, each letter in either case: a pattern."""
    return "".join(c if c.isdigit() else f"[{c}{c.upper()}]" for c in f"{value:0{width}x}")


def _spellings(char: str) -> str:
    """A pattern for one character of a secret as a server may echo it: itself, percent-encoded (its UTF-8
    bytes, hex digits in either case; ``+`` for a space), JSON-escaped (``\\uXXXX``, a surrogate pair beyond the
    BMP, or the short escapes) or as an HTML character reference."""
    options = [re.escape(char), "".join("%" + _hex(b, 2) for b in char.encode())]
    code = ord(char)
    if code < 0x10000:
        options.append(r"\\u" + _hex(code, 4))
    else:
        high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
        options.append(r"\\u" + _hex(high, 4) + r"\\u" + _hex(low, 4))
    if char in _JSON_SHORT:
        options.append(re.escape(_JSON_SHORT[char]))
    if char == " ":
        options.append(r"\+")
    options.append(f"&#0{{0,4}}{code};|&#[xX]0{{0,4}}{_hex(code, 1)};")
    if html.escape(char) != char:
        options.append(re.escape(html.escape(char)))
    return "(?:" + "|".join(options) + ")"


def _base64_pieces(secret: str) -> set[str]:
    """The base64 characters that hold only the secret's bits, for each of the 3 places it can start at within
    an encoded text (``Basic`` credentials, a header echoed in base64), in both alphabets."""
    data = secret.encode()
    pieces = set()
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + data).decode("ascii")
        piece = encoded[-(-8 * shift // 6):8 * (shift + len(data)) // 6]
        if len(piece) >= 4:
            pieces |= {piece, piece.translate(_URLSAFE)}
    return pieces


class Redactor:
    """Replaces every secret by a mask, in every form a server can plausibly echo it in: raw, percent-encoded
    (any bytes, either case), JSON-escaped, as HTML character references, any mix of these, in any letter case,
    or base64 (standard or URL-safe); and credentials inside URLs by ``***``. ``found`` tells whether a text
    holds a secret."""

    def __init__(self, secrets: Iterable[str] = ()):
        patterns: list[str] = []
        self.longest = 0
        """The most characters a secret's echo can take (a text cut within that of its end may hold a piece)."""
        for secret in secrets:
            if secret:
                patterns.append("".join(_spellings(c) for c in secret))
                patterns += [re.escape(p) for p in sorted(_base64_pieces(secret), key=len, reverse=True)]
                self.longest = max(self.longest, 16 * len(secret.encode()))
        # case ignored too: a server that echoes headers lower-cased still holds the key's letters
        self._pattern = re.compile("|".join(patterns), re.IGNORECASE) if patterns else None

    def found(self, text: str) -> bool:
        return self._pattern is not None and self._pattern.search(text) is not None

    def cut(self, text: str) -> str:
        """``text`` that was cut short (a body read up to a limit), less its last ``longest`` characters, where
        a secret may have been cut in two: the masks cannot know a piece of one."""
        return text[:-self.longest] + "…" if self.longest else text

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(MASK, text)
        return strip_url_credentials(text)
