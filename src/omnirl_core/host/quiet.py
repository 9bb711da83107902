"""Library warnings that repeat every step (a tokenizer truncating a long prompt warns on every encode) are
shown once per process: the first occurrence of each kind of message passes, later ones are dropped.

Two messages are of one kind when they differ only in quoted text, bracketed lists and numbers (the
truncated words of each prompt, its length)."""

from __future__ import annotations

import logging
import re
import warnings

LIBRARY_LOGGERS = ("transformers", "diffusers", "peft")
_VARIABLE = re.compile(r"\[.*\]|'[^']*'|\"[^\"]*\"|`[^`]*`|\d+(\.\d+)?", re.DOTALL)


def kind(message: str) -> str:
    return _VARIABLE.sub("_", message)[:200]


class OncePerKind(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.split(".")[0] not in LIBRARY_LOGGERS:
            return True  # errors, and omnirl's own messages, always pass
        key = f"{record.name}:{kind(record.getMessage())}"
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_FILTER = OncePerKind()


def show_repeats_once() -> None:
    """Install the filter on the handlers that print the libraries' messages (a logger's own filters do not
    see its children's records; its handlers do) and on Python warnings. Call it after the libraries have
    set up their loggers (after a model loads); idempotent."""
    handlers = list(logging.getLogger().handlers)
    for name in LIBRARY_LOGGERS:
        handlers += logging.getLogger(name).handlers
    for handler in handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    warnings.simplefilter("once", UserWarning)  # the default already shows each (text, place) once per module
