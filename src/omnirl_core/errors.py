"""Errors that reach the user: a first line that says what is wrong, details, and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_PLUGIN = 3


class OmnirlError(Exception):
    """Base error with a user-facing message, optional details and a hint; carries its exit code."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, details: Iterable[str] = (), hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.details = list(details)
        self.hint = hint

    def render(self) -> str:
        lines = [self.message, *self.details]
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class UsageError(OmnirlError):
    """Bad command-line usage or an invalid run setup."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """An invalid configuration: every problem of one config is reported together, each with its path."""


class PluginError(OmnirlError):
    """A component could not be resolved: unknown, ambiguous, broken, or incompatible."""

    exit_code = EXIT_PLUGIN


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


class RunInterrupted(OmnirlError):
    """A run stopped by SIGINT / SIGTERM after saving what it could; exit code 130 / 143 as a shell reports."""

    def __init__(self, message: str, exit_code: int = 130, **kwargs):
        super().__init__(message, **kwargs)
        self.exit_code = exit_code
